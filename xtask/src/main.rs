//! Project chores: `cargo xtask check-layers`, `cargo xtask bench`.

mod bench;
mod layers;

use std::process::ExitCode;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("check-layers") => check_layers(),
        Some("bench") => bench::run(&args[1..]),
        _ => {
            eprintln!(
                "usage: cargo xtask <command>\n\n\
                 commands:\n  check-layers   check the crate layering rules (SPEC §1)\n  \
                 bench [PART…]  run the benchmarks (parts: {})",
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
