//! polygw (being built).
