//! polygw-transport-openai (being built).
