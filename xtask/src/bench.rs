//! `cargo xtask bench [PART…]`: runs the workspace's benchmarks in release mode, part by
//! part, so one command reproduces docs/BENCHMARKS.md. Every benchmark is a `harness =
//! false` program (hand-written, or criterion for the memory limiter's ns/op) that prints
//! its method, its same-run baseline and the load average; none asserts a duration.

use std::process::{Command, ExitCode};

/// One part: its name, whether a bare `cargo xtask bench` runs it, what it measures, and
/// the cargo arguments.
struct Part {
    name: &'static str,
    in_all: bool,
    what: &'static str,
    cargo: &'static [&'static str],
}

const BENCHES: &[Part] = &[
    Part {
        name: "overhead",
        in_all: true,
        what: "GatewayClient vs direct reqwest: added µs, TTFT, calls/s, telemetry on/off; on glibc's malloc, then the same program on mimalloc",
        cargo: &[
            "bench",
            "-p",
            "polygw",
            "--bench",
            "overhead",
            "--bench",
            "overhead_mimalloc",
        ],
    },
    Part {
        name: "serve",
        in_all: true,
        what: "polygw serve vs calling the upstream directly (POLYGW_BENCH_SERVE_BASELINE: an earlier binary beside it); per-call syscalls, context switches, allocations (perf, root); RSS after 10 000 and 400 000 calls",
        cargo: &["bench", "-p", "polygw-cli", "--bench", "serve"],
    },
    Part {
        name: "serve-instructions",
        in_all: true,
        what: "instructions per proxied plain call and stream (callgrind; POLYGW_BENCH_SERVE_BASELINE for an earlier binary beside it)",
        cargo: &[
            "bench",
            "-p",
            "polygw-cli",
            "--bench",
            "serve",
            "--",
            "--instructions",
        ],
    },
    Part {
        name: "serve-otel",
        in_all: true,
        what: "the proxy's CPU per call with OpenTelemetry export off / on / receiver down / receiver slow, as ratios in one run (SPEC §26.1: ≤ 1.10×)",
        cargo: &[
            "bench",
            "-p",
            "polygw-cli",
            "--bench",
            "serve",
            "--",
            "--otel",
        ],
    },
    Part {
        name: "estimate",
        in_all: true,
        what: "the prompt estimate's error against the o200k tokenizer: English, Chinese, code, tool-call JSON; a 40 KB tool call; an image",
        cargo: &["bench", "-p", "polygw", "--bench", "estimate"],
    },
    Part {
        name: "hedging",
        in_all: true,
        what: "hedging efficacy on the long-tail profile (off / first-token / stall / both)",
        cargo: &["bench", "-p", "polygw", "--bench", "hedging"],
    },
    Part {
        name: "cache-affinity",
        in_all: true,
        what: "prompt-cache affinity off / session: cache hit share and bill vs the one-source ideal, 1 and 3 processes on one Redis",
        cargo: &[
            "bench",
            "-p",
            "polygw",
            "--features",
            "redis",
            "--bench",
            "cache_affinity",
        ],
    },
    Part {
        name: "governance",
        in_all: true,
        what: "memory limiter ns/op (criterion) and acquire + settle; Redis per script and shared by 4 processes",
        cargo: &[
            "bench",
            "-p",
            "polygw-limiter-memory",
            "-p",
            "polygw-limiter-redis",
        ],
    },
    Part {
        name: "governance-processes",
        in_all: false,
        what: "only the 4-process Redis part of `governance`",
        cargo: &[
            "bench",
            "-p",
            "polygw-limiter-redis",
            "--bench",
            "redis_processes",
        ],
    },
    Part {
        name: "telemetry",
        in_all: true,
        what: "record() cost; rows/s into SQLite and PostgreSQL",
        cargo: &[
            "bench",
            "-p",
            "polygw-telemetry-sql",
            "--bench",
            "telemetry",
        ],
    },
    Part {
        name: "transport",
        in_all: true,
        what: "SSE parser throughput; loopback streams/s",
        cargo: &[
            "bench",
            "-p",
            "polygw-transport-openai",
            "--bench",
            "stream",
        ],
    },
];

/// The part names.
pub const PARTS: &[&str] = &[
    "overhead",
    "serve",
    "serve-instructions",
    "serve-otel",
    "estimate",
    "hedging",
    "cache-affinity",
    "governance",
    "governance-processes",
    "telemetry",
    "transport",
];

/// Runs the named parts (all but the sub-parts when none is named).
pub fn run(args: &[String]) -> ExitCode {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    for a in args {
        if a == "--list" || a == "-l" {
            for p in BENCHES {
                println!(
                    "{:<22} {}{}",
                    p.name,
                    p.what,
                    if p.in_all {
                        ""
                    } else {
                        " (not in the default run)"
                    }
                );
            }
            return ExitCode::SUCCESS;
        }
        if !PARTS.contains(&a.as_str()) {
            eprintln!("bench: unknown part `{a}`; parts: {}", PARTS.join(", "));
            return ExitCode::from(2);
        }
    }
    // A part that fails (its calls, or a gate such as `serve`'s per-call counts) is
    // reported and the next parts still run; the exit status says one failed.
    let mut failed = Vec::new();
    for part in BENCHES {
        let wanted = if args.is_empty() {
            part.in_all
        } else {
            args.iter().any(|a| a == part.name)
        };
        if !wanted {
            continue;
        }
        println!("== bench: {} ({}) ==", part.name, part.what);
        let status = Command::new(&cargo).args(part.cargo).status();
        match status {
            Ok(s) if s.success() => {}
            Ok(s) => {
                eprintln!("bench {} failed: {s}", part.name);
                failed.push(part.name);
            }
            Err(e) => {
                eprintln!("bench {}: cannot run cargo: {e}", part.name);
                return ExitCode::FAILURE;
            }
        }
    }
    if failed.is_empty() {
        ExitCode::SUCCESS
    } else {
        eprintln!("bench: failed: {}", failed.join(", "));
        ExitCode::FAILURE
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_part_is_listed_once() {
        let names: Vec<&str> = BENCHES.iter().map(|p| p.name).collect();
        assert_eq!(names, PARTS);
    }
}
