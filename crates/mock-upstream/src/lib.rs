//! polygw-mock-upstream (being built).
