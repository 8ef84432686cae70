//! `cargo xtask test [ARGS…]`: the project's one test command. Installs cargo-nextest
//! when it is missing (a machine with only Rust stable), runs
//! `cargo nextest run --workspace ARGS…` (the profile comes from `NEXTEST_PROFILE`,
//! which nextest reads itself), then the doc tests (`cargo test --workspace --doc`,
//! which nextest does not run). Both run even when the first fails; the command fails
//! if either did.

use std::process::{Command, ExitCode};

/// The cargo-nextest release installed when none is found (builds with Rust 1.91+).
pub const CARGO_NEXTEST_VERSION: &str = "0.9.143";

fn cargo() -> String {
    std::env::var("CARGO").unwrap_or_else(|_| "cargo".into())
}

fn nextest_version() -> Option<String> {
    let out = Command::new(cargo())
        .args(["nextest", "--version"])
        .output()
        .ok()?;
    out.status.success().then(|| {
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .next()
            .unwrap_or_default()
            .to_string()
    })
}

/// The commands `cargo xtask test ARGS…` runs, in order.
pub fn plan(args: &[String]) -> Vec<Vec<String>> {
    let mut nextest: Vec<String> = ["nextest", "run", "--workspace"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    nextest.extend(args.iter().cloned());
    let doc = ["test", "--workspace", "--doc"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    vec![nextest, doc]
}

fn status(args: &[String]) -> bool {
    println!("xtask test: cargo {}", args.join(" "));
    match Command::new(cargo()).args(args).status() {
        Ok(s) => s.success(),
        Err(e) => {
            eprintln!("xtask test: cannot run cargo {}: {e}", args.join(" "));
            false
        }
    }
}

/// `cargo xtask test`.
pub fn run(args: &[String]) -> ExitCode {
    if nextest_version().is_none() {
        println!(
            "xtask test: cargo-nextest is missing: cargo install --locked cargo-nextest@{CARGO_NEXTEST_VERSION}"
        );
        let install = [
            "install",
            "--locked",
            &format!("cargo-nextest@{CARGO_NEXTEST_VERSION}"),
        ]
        .map(String::from);
        if !status(&install) {
            eprintln!("xtask test: installing cargo-nextest failed");
            return ExitCode::FAILURE;
        }
    }
    if let Some(v) = nextest_version() {
        println!("xtask test: {v}");
    }
    if let Ok(p) = std::env::var("NEXTEST_PROFILE") {
        println!("xtask test: nextest profile {p} (NEXTEST_PROFILE)");
    }
    let results: Vec<(String, bool)> = plan(args)
        .into_iter()
        .map(|cmd| {
            let ok = status(&cmd);
            (cmd.join(" "), ok)
        })
        .collect();
    let failed: Vec<&str> = results
        .iter()
        .filter(|(_, ok)| !ok)
        .map(|(c, _)| c.as_str())
        .collect();
    if failed.is_empty() {
        println!("xtask test: all passed");
        ExitCode::SUCCESS
    } else {
        eprintln!("xtask test: failed: cargo {}", failed.join("; cargo "));
        ExitCode::FAILURE
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nextest_gets_the_extra_args_and_doc_tests_follow() {
        let p = plan(&["-p".into(), "polygw".into()]);
        assert_eq!(
            p[0],
            ["nextest", "run", "--workspace", "-p", "polygw"].map(String::from)
        );
        assert_eq!(p[1], ["test", "--workspace", "--doc"].map(String::from));
    }
}
