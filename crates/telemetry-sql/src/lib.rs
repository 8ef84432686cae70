//! polygw-telemetry-sql (being built).
