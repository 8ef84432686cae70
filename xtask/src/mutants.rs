//! `cargo xtask mutants [FILE…]`: cargo-mutants on `polygw-core` (every file, or the
//! files named; a run skips what an earlier one caught: `--iterate`, and each mutant's
//! latest outcome is kept in `target/mutants/ledger.txt`), then the score of each file —
//! (caught + timed out) ÷ (caught + missed + timed out), unviable mutants left out — against the 90 %
//! a core file must reach (issue 22). Mutants known to be equivalent (no test can tell
//! them from the original) are listed, each under its reason, in
//! [`EQUIVALENT`]: they are not run, and the scores leave them out and count them
//! apart. Not run by CI: a whole run takes hours on the 2-core VM. Results:
//! docs/MUTANTS.md.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Command, ExitCode};

/// The cargo-mutants release the scores were measured with.
pub const CARGO_MUTANTS_VERSION: &str = "27.1.0";

/// A core file's share of viable mutants caught must reach this.
pub const TARGET: f64 = 0.9;

/// Where the run writes (`<dir>/mutants.out`).
const OUT: &str = "target/mutants";

/// The equivalent mutants: one mutant name per line as cargo-mutants writes it
/// (`path:line:col: what`), `#` lines giving the reasons.
pub const EQUIVALENT: &str = ".cargo/mutants-equivalent.txt";

/// The mutant names of an equivalents list (comments and blank lines left out).
pub fn equivalents(text: &str) -> Vec<String> {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(str::to_string)
        .collect()
}

/// A regex matching exactly `name` (cargo-mutants' `--exclude-re`).
pub fn exact_re(name: &str) -> String {
    let mut re = String::from("^");
    for c in name.chars() {
        if "\\.+*?()|[]{}^$#&-~".contains(c) {
            re.push('\\');
        }
        re.push(c);
    }
    re.push('$');
    re
}

/// One file's outcomes.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Score {
    pub caught: u32,
    pub missed: u32,
    pub timeout: u32,
    pub unviable: u32,
    /// Listed as equivalent (not viable for the score).
    pub equivalent: u32,
}

impl Score {
    /// Detected ÷ viable (`None` with no viable mutant): a mutant that makes the suite
    /// hang past its timeout is detected (the suite does not pass), as one a test fails.
    pub fn share(&self) -> Option<f64> {
        let viable = self.caught + self.missed + self.timeout;
        (viable > 0).then(|| f64::from(self.caught + self.timeout) / f64::from(viable))
    }
}

/// Per file, from cargo-mutants' outcome lists (`caught.txt`, `missed.txt`,
/// `timeout.txt`, `unviable.txt`: one mutant per line, `path:line:col: what`).
pub fn scores(lists: &[(&str, &str)]) -> BTreeMap<String, Score> {
    let mut out: BTreeMap<String, Score> = BTreeMap::new();
    for (kind, text) in lists {
        for line in text.lines().filter(|l| !l.trim().is_empty()) {
            let file = line.split(':').next().unwrap_or(line).to_string();
            let s = out.entry(file).or_default();
            match *kind {
                "caught" => s.caught += 1,
                "missed" => s.missed += 1,
                "timeout" => s.timeout += 1,
                "equivalent" => s.equivalent += 1,
                _ => s.unviable += 1,
            }
        }
    }
    out
}

/// The listed equivalent mutants of the files the ledger has outcomes for, one per line.
fn measured_equivalents(ledger: &BTreeMap<String, String>, equivalent: &[String]) -> String {
    let file = |m: &str| m.split(':').next().unwrap_or(m).to_string();
    let measured: std::collections::BTreeSet<String> = ledger.keys().map(|m| file(m)).collect();
    equivalent
        .iter()
        .filter(|m| measured.contains(&file(m)))
        .map(|m| format!("{m}\n"))
        .collect()
}

/// Each mutant's latest outcome, kept across runs in `<dir>/ledger.txt` (`outcome\tmutant`
/// lines): the last run's lists (`<dir>/mutants.out/*.txt`) overwrite what they name;
/// mutants an `--iterate` run skipped keep their earlier outcome.
fn update_ledger(dir: &Path) -> std::io::Result<BTreeMap<String, String>> {
    let path = dir.join("ledger.txt");
    let mut ledger: BTreeMap<String, String> = BTreeMap::new();
    if let Ok(text) = std::fs::read_to_string(&path) {
        for line in text.lines() {
            if let Some((outcome, mutant)) = line.split_once('\t') {
                ledger.insert(mutant.to_string(), outcome.to_string());
            }
        }
    }
    let out = dir.join("mutants.out");
    for k in ["caught", "missed", "timeout", "unviable"] {
        let text = std::fs::read_to_string(out.join(format!("{k}.txt"))).unwrap_or_default();
        for m in text.lines().filter(|l| !l.trim().is_empty()) {
            ledger.insert(m.to_string(), k.to_string());
        }
    }
    let text: String = ledger.iter().map(|(m, o)| format!("{o}\t{m}\n")).collect();
    std::fs::write(&path, text)?;
    Ok(ledger)
}

pub fn run(files: &[String]) -> ExitCode {
    let installed = Command::new("cargo")
        .args(["mutants", "--version"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !installed {
        eprintln!(
            "mutants: cargo-mutants is not installed (cargo install --locked cargo-mutants@{CARGO_MUTANTS_VERSION})"
        );
        return ExitCode::FAILURE;
    }
    if let Err(e) = std::fs::create_dir_all(OUT) {
        eprintln!("mutants: {OUT}: {e}");
        return ExitCode::FAILURE;
    }
    let mut cmd = Command::new("cargo");
    cmd.args([
        "mutants",
        "-p",
        "polygw-core",
        "--timeout",
        "120",
        "--test-tool",
        "nextest",
        "--profile",
        "mutants",
        // Skip what an earlier run caught (or found unviable): the ledger keeps it.
        "--iterate",
        "-o",
        OUT,
    ])
    // nextest's `mutants` profile: fail fast (a mutant is caught at its first failing
    // test).
    .env("NEXTEST_PROFILE", "mutants");
    let equivalent = equivalents(&std::fs::read_to_string(EQUIVALENT).unwrap_or_default());
    for name in &equivalent {
        cmd.args(["--exclude-re", &exact_re(name)]);
    }
    for f in files {
        cmd.args(["--file", f]);
    }
    // cargo-mutants exits non-zero when a mutant is missed: the scores say which.
    if let Err(e) = cmd.status() {
        eprintln!("mutants: cargo mutants could not run: {e}");
        return ExitCode::FAILURE;
    }
    let ledger = match update_ledger(Path::new(OUT)) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("mutants: {OUT}/ledger.txt: {e}");
            return ExitCode::FAILURE;
        }
    };
    let outcome = |m: &String, o: &String| {
        if equivalent.contains(m) {
            "equivalent".to_string()
        } else {
            o.clone()
        }
    };
    let mut lists: Vec<(&str, String)> = ["caught", "missed", "timeout", "unviable"]
        .into_iter()
        .map(|k| {
            let text: String = ledger
                .iter()
                .filter(|(m, o)| outcome(m, o) == k)
                .map(|(m, _)| format!("{m}\n"))
                .collect();
            (k, text)
        })
        .collect();
    // The listed equivalents were not run (excluded): counted for the files measured.
    lists.push(("equivalent", measured_equivalents(&ledger, &equivalent)));
    let borrowed: Vec<(&str, &str)> = lists.iter().map(|(k, t)| (*k, t.as_str())).collect();
    let scores = scores(&borrowed);
    if scores.is_empty() {
        eprintln!("mutants: no outcome in {OUT}");
        return ExitCode::FAILURE;
    }
    println!(
        "| file | caught | missed | timeout | unviable | equivalent | score |\n|---|---:|---:|---:|---:|---:|---:|"
    );
    let mut below = 0;
    for (file, s) in &scores {
        let share = s.share();
        if share.is_some_and(|x| x < TARGET) {
            below += 1;
        }
        println!(
            "| {file} | {} | {} | {} | {} | {} | {} |",
            s.caught,
            s.missed,
            s.timeout,
            s.unviable,
            s.equivalent,
            share.map_or("–".to_string(), |x| format!("{:.0} %", 100.0 * x))
        );
    }
    if below > 0 {
        eprintln!(
            "mutants: {below} file(s) below {:.0} % (missed mutants: {OUT}/ledger.txt)",
            100.0 * TARGET,
        );
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scores_count_per_file_and_leave_unviable_out() {
        let s = scores(&[
            (
                "caught",
                "crates/core/src/retry.rs:10:5: replace a with b\ncrates/core/src/retry.rs:12:1: x\ncrates/core/src/backoff.rs:3:1: y\n",
            ),
            ("missed", "crates/core/src/retry.rs:20:9: replace > with >=\n"),
            ("timeout", ""),
            ("unviable", "crates/core/src/backoff.rs:9:1: z\n"),
        ]);
        let r = s["crates/core/src/retry.rs"];
        assert_eq!((r.caught, r.missed, r.unviable), (2, 1, 0));
        assert!((r.share().unwrap() - 2.0 / 3.0).abs() < 1e-12);
        let b = s["crates/core/src/backoff.rs"];
        assert_eq!((b.caught, b.unviable, b.share()), (1, 1, Some(1.0)));
        assert_eq!(Score::default().share(), None);
        let hang = Score {
            caught: 1,
            timeout: 1,
            missed: 2,
            ..Score::default()
        };
        assert_eq!(hang.share(), Some(0.5), "a hang is detected");
    }

    #[test]
    fn the_ledger_keeps_what_a_later_run_skipped_and_takes_what_it_ran() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("mutants.out");
        std::fs::create_dir_all(&out).unwrap();
        let write =
            |k: &str, text: &str| std::fs::write(out.join(format!("{k}.txt")), text).unwrap();
        write("caught", "a.rs:1:1: x\n");
        write("missed", "a.rs:2:1: y\na.rs:3:1: z\n");
        write("unviable", "a.rs:4:1: w\n");
        let first = update_ledger(dir.path()).unwrap();
        assert_eq!(first["a.rs:2:1: y"], "missed");
        // An `--iterate` run: only the missed ones again; y is caught now.
        write("caught", "a.rs:2:1: y\n");
        write("missed", "a.rs:3:1: z\n");
        write("unviable", "");
        let second = update_ledger(dir.path()).unwrap();
        let outcomes: Vec<(&str, &str)> = second
            .iter()
            .map(|(m, o)| (m.as_str(), o.as_str()))
            .collect();
        assert_eq!(
            outcomes,
            [
                ("a.rs:1:1: x", "caught"),
                ("a.rs:2:1: y", "caught"),
                ("a.rs:3:1: z", "missed"),
                ("a.rs:4:1: w", "unviable"),
            ]
        );
        assert_eq!(
            update_ledger(dir.path()).unwrap(),
            second,
            "read back the same"
        );
    }

    #[test]
    fn equivalents_are_read_and_matched_exactly() {
        let list = equivalents(
            "# why\ncrates/core/src/breaker.rs:195:49: replace > with >= in BreakerState::record\n\n  # more\na.rs:1:2: replace || with && in f\n",
        );
        assert_eq!(
            list,
            [
                "crates/core/src/breaker.rs:195:49: replace > with >= in BreakerState::record",
                "a.rs:1:2: replace || with && in f"
            ]
        );
        assert_eq!(
            exact_re(&list[1]),
            r"^a\.rs:1:2: replace \|\| with \&\& in f$"
        );
        let s = scores(&[("equivalent", "a.rs:1:2: x\n"), ("caught", "a.rs:3:1: y\n")]);
        assert_eq!(s["a.rs"].equivalent, 1);
        assert_eq!(s["a.rs"].share(), Some(1.0), "not viable for the score");
    }

    #[test]
    fn listed_equivalents_count_for_the_files_measured_only() {
        let ledger: BTreeMap<String, String> = [("a.rs:3:1: y", "caught")]
            .into_iter()
            .map(|(m, o)| (m.to_string(), o.to_string()))
            .collect();
        let listed = equivalents("a.rs:1:2: x\nb.rs:4:4: z\n");
        assert_eq!(measured_equivalents(&ledger, &listed), "a.rs:1:2: x\n");
    }
}
