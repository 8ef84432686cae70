//! The `polygw` binary: everything is in the library (`polygw_cli::run`).

fn main() -> std::process::ExitCode {
    polygw_cli::run()
}
