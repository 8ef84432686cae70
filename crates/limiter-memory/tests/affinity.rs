//! The in-process affinity store against the testkit contract (SPEC §20.2), on a manual
//! clock: expiry cases move time, nothing waits.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use polygw_core::ports::{AffinityStore, Clock, ManualClock};
use polygw_limiter_memory::{shared_affinity, MemoryAffinity};
use polygw_testkit::affinity_contract::{self as ac, AffinityHarness};

/// One store per case; its clients are the process's clients of the scope (one state).
struct Mem {
    clock: Arc<ManualClock>,
    store: Arc<MemoryAffinity>,
}

impl Mem {
    fn new() -> Self {
        let clock = Arc::new(ManualClock::new(tokio::time::Instant::now().into_std(), 0));
        let dyn_clock: Arc<dyn Clock> = clock.clone();
        Mem {
            store: shared_affinity(&polygw_testkit::services::unique_name("MEMAFF"), dyn_clock),
            clock,
        }
    }
}

#[async_trait]
impl AffinityHarness for Mem {
    async fn store(&self) -> Arc<dyn AffinityStore> {
        self.store.clone()
    }
    async fn clients(&self, n: usize) -> Vec<Arc<dyn AffinityStore>> {
        (0..n)
            .map(|_| self.store.clone() as Arc<dyn AffinityStore>)
            .collect()
    }
    async fn advance(&self, by: Duration) {
        self.clock.advance(by);
    }
    fn ttl(&self) -> Duration {
        Duration::from_secs(300)
    }
    fn margin(&self) -> Duration {
        Duration::from_millis(1)
    }
}

macro_rules! cases {
    ($($name:ident),* $(,)?) => {$(
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $name() {
            ac::$name(&Mem::new()).await;
        }
    )*};
}

cases!(
    unknown_key_reads_none,
    put_then_get,
    put_replaces_the_source,
    scopes_and_keys_are_independent,
    expires_after_its_ttl,
    a_put_renews_the_ttl,
    zero_ttl_forgets,
    every_client_reads_what_one_wrote,
    concurrent_writers_leave_one_of_their_values,
    many_keys_are_read_and_written_at_once,
);

#[test]
fn every_case_runs_here() {
    let here = include_str!("affinity.rs");
    for case in ac::CASES {
        assert!(here.contains(&format!("    {case},\n")), "{case}");
    }
}
