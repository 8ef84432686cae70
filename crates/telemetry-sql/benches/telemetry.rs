//! Telemetry benchmark (being built).
fn main() {}
