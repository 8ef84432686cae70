//! Project chores: `cargo xtask test`, `check-layers`, `check-deny`, `bench`, `mutants`.

mod bench;
mod deny;
mod layers;
mod mutants;
mod test;

use std::process::ExitCode;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("test") => test::run(&args[1..]),
        Some("check-layers") => check_layers(),
        Some("check-deny") => deny::run(),
        Some("bench") => bench::run(&args[1..]),
        Some("mutants") => mutants::run(&args[1..]),
        _ => {
            eprintln!(
                "usage: cargo xtask <command>\n\n\
                 commands:\n  test [ARGS…]   every test: cargo nextest run --workspace ARGS… (installs\n                 cargo-nextest when missing; NEXTEST_PROFILE picks the profile), then\n                 the doc tests\n  \
                 check-layers   check the crate layering rules (SPEC §1)\n  \
                 check-deny     cargo deny passes, and fails on scratch copies with a\n                 forbidden edge\n  \
                 bench [PART…]  run the benchmarks (parts: {})\n  \
                 mutants [FILE…] cargo-mutants on polygw-core (or these files), scores per file",
                bench::PARTS.join(", ")
            );
            ExitCode::from(2)
        }
    }
}

fn check_layers() -> ExitCode {
    let meta = match layers::workspace_metadata() {
        Ok(m) => m,
        Err(e) => {
            eprintln!("check-layers: {e}");
            return ExitCode::FAILURE;
        }
    };
    let alone = match layers::core_alone() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("check-layers: {e}");
            return ExitCode::FAILURE;
        }
    };
    let violations = layers::check(&meta, Some(&alone));
    if violations.is_empty() {
        println!("check-layers: ok (core pure, adapters know only core, simulator and test support in place)");
        ExitCode::SUCCESS
    } else {
        for v in &violations {
            eprintln!("check-layers: {v}");
        }
        eprintln!("check-layers: {} violation(s)", violations.len());
        ExitCode::FAILURE
    }
}
