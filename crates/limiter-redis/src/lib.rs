//! polygw-limiter-redis (being built).
