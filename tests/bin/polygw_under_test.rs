//! The `polygw` program, built as this package's own binary target so that the
//! program-from-the-outside suites (`cli.rs`, `report.rs`) get it through
//! `CARGO_BIN_EXE_polygw-under-test`: cargo builds it before they run, whatever
//! command runs them. Same code as the shipped binary (`crates/cli/src/main.rs`).

fn main() -> std::process::ExitCode {
    polygw_cli::run()
}
