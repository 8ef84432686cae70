//! `cargo xtask test [ARGS…]`: the project's one test command. Installs cargo-nextest
//! when it is missing (a machine with only Rust stable), runs
//! `cargo nextest run --workspace ARGS…` (the profile comes from `NEXTEST_PROFILE`,
//! which nextest reads itself), then the doc tests (`cargo test --workspace --doc`,
//! which nextest does not run), then the tests of `polygw` built alone with its default
//! features (the workspace run unifies features: the test package turns on `schema`, so
//! the behaviour without it is only built this way). With `-p`/`--package` in ARGS the
//! run covers those packages only (no `--workspace`, no third step). Every step runs
//! even when an earlier one fails; the command fails if any did.

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
    let own = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<String>>();
    let packages: Vec<String> = args
        .iter()
        .enumerate()
        .filter_map(|(i, a)| match a.as_str() {
            "-p" | "--package" => args.get(i + 1).cloned(),
            _ => a
                .strip_prefix("--package=")
                .or_else(|| a.strip_prefix("-p").filter(|p| !p.is_empty()))
                .map(str::to_string),
        })
        .collect();
    if !packages.is_empty() {
        // Those packages only: `--workspace` would select every package anyway.
        let mut nextest = own(&["nextest", "run"]);
        nextest.extend(args.iter().cloned());
        let mut doc = own(&["test", "--doc"]);
        for p in &packages {
            doc.extend(["-p".to_string(), p.clone()]);
        }
        return vec![nextest, doc];
    }
    let mut nextest = own(&["nextest", "run", "--workspace"]);
    nextest.extend(args.iter().cloned());
    vec![
        nextest,
        own(&["test", "--workspace", "--doc"]),
        // polygw alone, default features (no `schema`): the tests of that build.
        own(&[
            "nextest",
            "run",
            "-p",
            "polygw",
            "--lib",
            "--test",
            "features",
            "-E",
            "test(/without_the/)",
        ]),
    ]
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
    fn the_workspace_run_then_doc_tests_then_polygw_alone() {
        let p = plan(&["--no-fail-fast".into()]);
        assert_eq!(
            p[0],
            ["nextest", "run", "--workspace", "--no-fail-fast"].map(String::from)
        );
        assert_eq!(p[1], ["test", "--workspace", "--doc"].map(String::from));
        assert_eq!(
            &p[2][..4],
            &["nextest", "run", "-p", "polygw"].map(String::from)
        );
        assert_eq!(p.len(), 3);
    }

    #[test]
    fn packages_narrow_the_run() {
        for args in [
            vec!["-p", "polygw"],
            vec!["--package", "polygw"],
            vec!["--package=polygw"],
            vec!["-ppolygw"],
        ] {
            let args: Vec<String> = args.into_iter().map(String::from).collect();
            let p = plan(&args);
            assert_eq!(p.len(), 2, "{args:?}");
            assert!(!p[0].contains(&"--workspace".to_string()), "{args:?}");
            assert_eq!(p[0][2..], args[..]);
            assert_eq!(p[1], ["test", "--doc", "-p", "polygw"].map(String::from));
        }
    }

    /// The default `polygw` build compiles SQLite only, and no jsonschema (issue 16).
    #[test]
    fn the_default_polygw_build_has_only_sqlite_and_no_jsonschema() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../Cargo.toml");
        let out = Command::new(cargo())
            .args([
                "tree", "-p", "polygw", "-e", "normal", "--prefix", "none", "--locked",
            ])
            .arg("--manifest-path")
            .arg(&root)
            .output()
            .expect("cargo tree");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let tree = String::from_utf8_lossy(&out.stdout);
        let has = |name: &str| tree.lines().any(|l| l.starts_with(&format!("{name} v")));
        assert!(has("sqlx-sqlite"), "{tree}");
        for absent in ["sqlx-postgres", "jsonschema", "redis", "rustls-pemfile"] {
            assert!(!has(absent), "{absent} in the default build");
        }
    }
}
