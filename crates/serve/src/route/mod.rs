//! One module per API route (SPEC §11, §18), each a few phase functions — parse,
//! resolve, call, answer — over the shared machinery of [`crate::http`] and
//! [`crate::stream`]. Adding an API is adding a module here and its routes in
//! [`crate::proxy`]; no other module changes.

pub mod admin;
pub mod chat;
pub mod embeddings;
pub mod messages;
pub mod meta;
pub mod responses;
