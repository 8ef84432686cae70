//! Test support for polygw (dev-dependency only): a tokio clock, local-service
//! discovery with the CI rule (mandatory under `CI=true`, skipped with a reason
//! otherwise), the port contract suites every implementation runs, and headless
//! Chromium for pages.

pub mod affinity_contract;
pub mod breaker_contract;
pub mod browser;
pub mod clock;
pub mod fakes;
pub mod limiter_contract;
pub mod services;
pub mod store_contract;
pub mod text;
