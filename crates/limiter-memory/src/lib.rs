//! polygw-limiter-memory (being built).
