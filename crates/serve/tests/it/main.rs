//! polygw-serve's own suites, from the outside: the proxy served on loopback by
//! `polygw_serve::serve`, a mock upstream behind it, clients speaking HTTP to it (an
//! OpenAI client, reqwest, raw sockets).

mod admin;
mod api;
mod conformance;
mod cross;
mod families;
mod hardening;
mod honest;
mod keys;
mod native;
mod recorded;
mod resume_native;
mod routes_rows;
mod support;
