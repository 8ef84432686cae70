//! The wire formats clients speak to `polygw serve` besides chat completions — the
//! OpenAI Responses API and the Anthropic Messages API — as pure conversions between
//! their requests, answers and stream events and polygw-core's types (SPEC §18).
//! (Being written: see the crate's modules as they land.)
