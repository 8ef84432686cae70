//! The Redis affinity store against the testkit contract (SPEC §20.2) on the single
//! server (`127.0.0.1:6379`) and on the local 3-node Redis Cluster (`.ci/run` starts it;
//! both mandatory under `CI=true`): every client is a connection of its own, as another
//! process's would be; expiry is the server's (`PX`), so the expiry cases wait, with a
//! margin, on real time.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use polygw_core::ports::AffinityStore;
use polygw_limiter_redis::{RedisGovernance, RedisOptions};
use polygw_testkit::affinity_contract::{self as ac, AffinityHarness};
use polygw_testkit::services::{redis_cluster_url, redis_url};

struct Real {
    url: String,
    gov: RedisGovernance,
}

fn opts() -> RedisOptions {
    // Semantics, not timeouts: generous bounds for a loaded CI machine.
    RedisOptions {
        connect_timeout: Duration::from_secs(5),
        response_timeout: Duration::from_secs(10),
        operation_timeout: Duration::from_secs(15),
        ..RedisOptions::default()
    }
}

async fn harness(url: &str) -> Real {
    Real {
        url: url.to_string(),
        gov: RedisGovernance::connect(url, opts())
            .await
            .expect("connect"),
    }
}

#[async_trait]
impl AffinityHarness for Real {
    async fn store(&self) -> Arc<dyn AffinityStore> {
        Arc::new(self.gov.affinity_store())
    }
    async fn clients(&self, n: usize) -> Vec<Arc<dyn AffinityStore>> {
        let mut out: Vec<Arc<dyn AffinityStore>> = Vec::new();
        for _ in 0..n {
            let g = RedisGovernance::connect(&self.url, opts())
                .await
                .expect("connect a client");
            out.push(Arc::new(g.affinity_store()));
        }
        out
    }
    async fn advance(&self, by: Duration) {
        tokio::time::sleep(by).await;
    }
    fn ttl(&self) -> Duration {
        Duration::from_millis(1500)
    }
    fn margin(&self) -> Duration {
        Duration::from_millis(250)
    }
}

macro_rules! cases {
    ($url:path; $($name:ident),* $(,)?) => {$(
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $name() {
            let Some(url) = $url() else { return };
            ac::$name(&harness(&url).await).await;
        }
    )*};
}

macro_rules! all_cases {
    ($url:path) => {
        cases!(
            $url;
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
    };
}

mod single {
    use super::*;
    all_cases!(redis_url);
}

mod cluster {
    use super::*;
    all_cases!(redis_cluster_url);
}

mod redis_specific {
    use super::*;

    /// One small key per session under the scope's hash tag, with a TTL; a key name
    /// that is not a digest never reaches Redis.
    #[tokio::test]
    async fn one_expiring_key_per_session_under_the_scope_tag() {
        let Some(url) = redis_url() else { return };
        let h = harness(&url).await;
        let s = h.gov.affinity_store();
        let scope = polygw_testkit::services::unique_name("AFFK");
        let key = polygw_core::affinity::AffinityKey::given("session-1");
        s.put(&scope, key.as_str(), "openai-0", Duration::from_secs(300))
            .await
            .unwrap();
        let client = redis::Client::open(url.as_str()).unwrap();
        let mut c = client.get_multiplexed_async_connection().await.unwrap();
        let name = format!("polygw:{{{scope}}}:aff:{}", key.as_str());
        let v: Option<String> = redis::cmd("GET")
            .arg(&name)
            .query_async(&mut c)
            .await
            .unwrap();
        assert_eq!(v.as_deref(), Some("openai-0"));
        let ttl: i64 = redis::cmd("PTTL")
            .arg(&name)
            .query_async(&mut c)
            .await
            .unwrap();
        assert!((290_000..=300_000).contains(&ttl), "{ttl}");
        let pattern = format!("polygw:{{{scope}}}:*");
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg(&pattern)
            .query_async(&mut c)
            .await
            .unwrap();
        assert_eq!(keys, [name]);
        for bad in ["", "a:b", "{x}", &"f".repeat(65)] {
            assert!(s.get(&scope, bad).await.is_err(), "{bad:?}");
            assert!(s
                .put(&scope, bad, "x", Duration::from_secs(1))
                .await
                .is_err());
        }
        assert!(
            s.get("A{B", key.as_str()).await.is_err(),
            "braces in a scope"
        );
    }
}

#[test]
fn every_case_runs_here() {
    let here = include_str!("affinity.rs");
    for case in ac::CASES {
        assert!(here.contains(&format!("            {case},\n")), "{case}");
    }
}
