//! polygw-testkit (being built).
