//! `cargo xtask check-deny`: `cargo deny check bans licenses sources` passes on the
//! workspace, and fails on scratch copies of it that each add one forbidden edge (an
//! adapter depending on an I/O crate it does not wrap, an adapter depending on another
//! adapter) — the negative check that shows deny.toml's rules bite.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The cargo-deny release `.ci/run` installs (builds with the machine's Rust 1.95).
pub const CARGO_DENY_VERSION: &str = "0.20.2";

/// The checks CI runs.
pub const CHECKS: &[&str] = &["bans", "licenses", "sources"];

/// One forbidden edge: a line added to a member's `[dependencies]`, and what
/// cargo-deny must then name.
#[derive(Debug, Clone, Copy)]
pub struct Forbidden {
    /// Member manifest, relative to the workspace root.
    pub manifest: &'static str,
    /// The dependency line added under `[dependencies]`.
    pub line: &'static str,
    /// The banned crate cargo-deny must report.
    pub banned: &'static str,
    /// What the edge breaks.
    pub why: &'static str,
}

/// The edges the negative check adds, one scratch copy each.
pub const FORBIDDEN: &[Forbidden] = &[
    Forbidden {
        manifest: "crates/limiter-memory/Cargo.toml",
        line: "reqwest.workspace = true",
        banned: "reqwest",
        why: "an adapter using an I/O crate it does not wrap",
    },
    Forbidden {
        manifest: "crates/limiter-redis/Cargo.toml",
        line: "sqlx.workspace = true",
        banned: "sqlx",
        why: "the Redis adapter using the SQL adapter's driver",
    },
    Forbidden {
        manifest: "crates/limiter-redis/Cargo.toml",
        line: "polygw-telemetry-sql.workspace = true",
        banned: "polygw-telemetry-sql",
        why: "an adapter depending on another adapter",
    },
];

/// The workspace root (xtask's parent).
pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask has a parent dir")
        .to_path_buf()
}

fn cargo() -> String {
    std::env::var("CARGO").unwrap_or_else(|_| "cargo".into())
}

/// Whether `cargo deny` runs here (its version, when it does).
pub fn installed() -> Option<String> {
    let out = Command::new(cargo())
        .args(["deny", "--version"])
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// The outcome of one `cargo deny check` run.
#[derive(Debug)]
pub struct Run {
    /// It passed.
    pub ok: bool,
    /// stdout and stderr together.
    pub output: String,
}

/// `cargo deny [--offline] check bans licenses sources` on the workspace at `root`.
pub fn check(root: &Path, offline: bool) -> Result<Run, String> {
    let mut cmd = Command::new(cargo());
    cmd.arg("deny");
    if offline {
        cmd.arg("--offline");
    }
    cmd.args(["--color", "never", "--manifest-path"])
        .arg(root.join("Cargo.toml"))
        .arg("--config")
        .arg(root.join("deny.toml"))
        .arg("check")
        .args(CHECKS)
        .current_dir(root);
    let out = cmd
        .output()
        .map_err(|e| format!("cannot run cargo deny: {e}"))?;
    let mut output = String::from_utf8_lossy(&out.stdout).into_owned();
    output.push_str(&String::from_utf8_lossy(&out.stderr));
    Ok(Run {
        ok: out.status.success(),
        output,
    })
}

/// Copies the workspace sources (no `target/`, no `.git`) to `to`.
pub fn copy_workspace(from: &Path, to: &Path) -> Result<(), String> {
    fn walk(from: &Path, to: &Path) -> std::io::Result<()> {
        std::fs::create_dir_all(to)?;
        for entry in std::fs::read_dir(from)? {
            let entry = entry?;
            let name = entry.file_name();
            if name == "target" || name == ".git" {
                continue;
            }
            let (src, dst) = (entry.path(), to.join(&name));
            if entry.file_type()?.is_dir() {
                walk(&src, &dst)?;
            } else {
                std::fs::copy(&src, &dst)?;
            }
        }
        Ok(())
    }
    walk(from, to).map_err(|e| format!("copying {} to {}: {e}", from.display(), to.display()))
}

/// Adds `line` under the `[dependencies]` table of `manifest`.
pub fn add_dependency(manifest: &Path, line: &str) -> Result<(), String> {
    let text = std::fs::read_to_string(manifest)
        .map_err(|e| format!("reading {}: {e}", manifest.display()))?;
    let Some(at) = text.find("[dependencies]\n") else {
        return Err(format!(
            "{} has no [dependencies] table",
            manifest.display()
        ));
    };
    let at = at + "[dependencies]\n".len();
    let edited = format!("{}{line}\n{}", &text[..at], &text[at..]);
    std::fs::write(manifest, edited).map_err(|e| format!("writing {}: {e}", manifest.display()))
}

/// Runs cargo-deny on a scratch copy with `edge` added; `Ok` when it fails naming the
/// banned crate, `Err` with the reason otherwise.
pub fn rejects(edge: &Forbidden) -> Result<(), String> {
    let scratch = tempfile::Builder::new()
        .prefix("polygw-deny-")
        .tempdir()
        .map_err(|e| format!("temp dir: {e}"))?;
    copy_workspace(&root(), scratch.path())?;
    add_dependency(&scratch.path().join(edge.manifest), edge.line)?;
    // Offline: every crate the edge needs is in Cargo.lock and the local registry.
    let run = check(scratch.path(), true)?;
    let named = run.output.contains(&format!("crate '{} = ", edge.banned))
        && run.output.contains("is explicitly banned");
    match (run.ok, named) {
        (false, true) => Ok(()),
        (false, false) => Err(format!(
            "cargo deny failed on `{}` in {} ({}), but not by banning `{}`:\n{}",
            edge.line, edge.manifest, edge.why, edge.banned, run.output
        )),
        (true, _) => Err(format!(
            "cargo deny passed a scratch copy with `{}` in {} ({})",
            edge.line, edge.manifest, edge.why
        )),
    }
}

/// `cargo xtask check-deny`.
pub fn run() -> std::process::ExitCode {
    use std::process::ExitCode;
    let Some(version) = installed() else {
        eprintln!(
            "check-deny: cargo-deny is not installed: cargo install --locked cargo-deny@{CARGO_DENY_VERSION}"
        );
        return ExitCode::FAILURE;
    };
    println!("check-deny: {version}");
    match check(&root(), false) {
        Ok(r) if r.ok => println!("check-deny: the workspace passes ({})", CHECKS.join(", ")),
        Ok(r) => {
            eprintln!("{}", r.output);
            eprintln!("check-deny: the workspace fails cargo deny");
            return ExitCode::FAILURE;
        }
        Err(e) => {
            eprintln!("check-deny: {e}");
            return ExitCode::FAILURE;
        }
    }
    let mut failed = 0;
    for edge in FORBIDDEN {
        match rejects(edge) {
            Ok(()) => println!(
                "check-deny: rejected as it must: `{}` in {} ({})",
                edge.line, edge.manifest, edge.why
            ),
            Err(e) => {
                failed += 1;
                eprintln!("check-deny: {e}");
            }
        }
    }
    if failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// cargo-deny installed: every forbidden edge makes it fail. Outside CI a machine
    /// without it skips, saying why; under `CI=true` that is a failure.
    #[test]
    fn cargo_deny_rejects_forbidden_edges() {
        if installed().is_none() {
            let msg = format!(
                "cargo-deny is not installed (cargo install --locked cargo-deny@{CARGO_DENY_VERSION})"
            );
            if std::env::var("CI").as_deref() == Ok("true") {
                panic!("{msg}: required under CI=true");
            }
            eprintln!("skipping: {msg}");
            return;
        }
        for edge in FORBIDDEN {
            if let Err(e) = rejects(edge) {
                panic!("{e}");
            }
        }
    }

    #[test]
    fn a_dependency_lands_in_the_dependencies_table() {
        let dir = tempfile::tempdir().unwrap();
        let m = dir.path().join("Cargo.toml");
        std::fs::write(
            &m,
            "[package]\nname = \"x\"\n\n[dependencies]\nserde = \"1\"\n\n[dev-dependencies]\n",
        )
        .unwrap();
        add_dependency(&m, "reqwest.workspace = true").unwrap();
        let text = std::fs::read_to_string(&m).unwrap();
        assert!(
            text.contains("[dependencies]\nreqwest.workspace = true\nserde = \"1\"\n"),
            "{text}"
        );
        let none = dir.path().join("none.toml");
        std::fs::write(&none, "[package]\nname = \"x\"\n").unwrap();
        assert!(add_dependency(&none, "a = \"1\"").is_err());
    }
}
