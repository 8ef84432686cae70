//! `cargo xtask bench`: runs every benchmark of the workspace in release mode, part by
//! part, so one command reproduces docs/BENCHMARKS.md.

use std::process::{Command, ExitCode};

/// (part, cargo arguments).
const BENCHES: &[(&str, &[&str])] = &[
    (
        "governance",
        &[
            "bench",
            "-p",
            "polygw-limiter-memory",
            "-p",
            "polygw-limiter-redis",
        ],
    ),
    ("telemetry", &["bench", "-p", "polygw-telemetry-sql"]),
];

/// The part names.
pub const PARTS: &[&str] = &["governance", "telemetry"];

/// Runs the named parts (all when none is named).
pub fn run(args: &[String]) -> ExitCode {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    for a in args {
        if !PARTS.contains(&a.as_str()) {
            eprintln!("bench: unknown part `{a}`; parts: {}", PARTS.join(", "));
            return ExitCode::from(2);
        }
    }
    for (part, cargo_args) in BENCHES {
        if !args.is_empty() && !args.iter().any(|a| a == part) {
            continue;
        }
        println!("== bench: {part} ==");
        let status = Command::new(&cargo).args(*cargo_args).status();
        match status {
            Ok(s) if s.success() => {}
            Ok(s) => {
                eprintln!("bench {part} failed: {s}");
                return ExitCode::FAILURE;
            }
            Err(e) => {
                eprintln!("bench {part}: cannot run cargo: {e}");
                return ExitCode::FAILURE;
            }
        }
    }
    ExitCode::SUCCESS
}
