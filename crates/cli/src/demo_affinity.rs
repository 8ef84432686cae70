//! `polygw demo`'s prompt-cache line (SPEC §20.2): a small multi-turn workload against
//! three simulated upstreams that each keep a prefix cache, with `AFFINITY=off` and with
//! the default (`session`); the share of prompt tokens read from a cache and the bill of
//! each. The full measurement is `cargo xtask bench cache-affinity` (docs/BENCHMARKS.md).

use anyhow::{Context, Result};
use polygw::{ChatRequest, GatewayClient, Message};
use polygw_mock_upstream::{Behavior, CacheDialect, MockConfig, MockUpstream, PrefixCache, Prices};

/// Sessions and turns per session.
pub const SESSIONS: usize = 24;
pub const TURNS: usize = 6;
/// Prices per 1M tokens (input, cached input, output), on the mocks and the sources.
const PRICES: (f64, f64, f64) = (2.0, 0.5, 8.0);

/// What one run of the workload gave.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct CacheFigures {
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    /// Σ of the calls' costs by the sources' prices (what the mocks bill).
    pub cost: f64,
    pub failures: usize,
}

impl CacheFigures {
    /// Cached share of the prompt tokens, %.
    pub fn hit_share(&self) -> f64 {
        if self.prompt_tokens == 0 {
            return 0.0;
        }
        100.0 * self.cached_tokens as f64 / self.prompt_tokens as f64
    }
}

/// The shared system prompt: 8 000 characters, 2 000 tokens in the mock's count.
fn system_prompt() -> String {
    "You are the support assistant of a large online shop. Answer precisely. "
        .repeat(120)
        .chars()
        .take(8000)
        .collect()
}

fn question(s: usize, t: usize) -> String {
    let mut q = format!(
        "Session {s}, question {t}: where is order {}? ",
        s * 100 + t
    );
    while q.len() < 400 {
        q.push_str("Please explain the delivery options. ");
    }
    q.truncate(400);
    q
}

fn answer_chunks() -> Vec<String> {
    (0..50).map(|i| format!("w{:02} ", i)).collect()
}

/// Turn `t` of session `s`: the conversation so far, then the next question.
fn request(system: &str, s: usize, t: usize) -> ChatRequest {
    let answer = answer_chunks().concat();
    let mut m = vec![Message::system(system)];
    for i in 0..t {
        m.push(Message::user(question(s, i)));
        m.push(Message::assistant(answer.clone()));
    }
    m.push(Message::user(question(s, t)));
    ChatRequest::new(m)
}

fn vars(scope: &str, urls: &[String], affinity: Option<&str>) -> Vec<(String, String)> {
    let mut v = vec![
        (format!("{scope}__HEDGE__AFTER_S"), "off".to_string()),
        (format!("{scope}__HEDGE__STALL_AFTER_S"), "off".to_string()),
    ];
    if let Some(a) = affinity {
        v.push((format!("{scope}__AFFINITY"), a.to_string()));
    }
    for (i, url) in urls.iter().enumerate() {
        let p = format!("{scope}__SIM__{i}__");
        for (k, x) in [
            ("BASE_URL", url.clone()),
            ("API_KEY", String::new()),
            ("MODEL", "sim-cache".to_string()),
            ("INPUT_PRICE", PRICES.0.to_string()),
            ("CACHED_INPUT_PRICE", PRICES.1.to_string()),
            ("OUTPUT_PRICE", PRICES.2.to_string()),
        ] {
            v.push((format!("{p}{k}"), x));
        }
    }
    v
}

/// One run on fresh upstreams (empty caches): every round runs turn `t` of every session
/// at once. `affinity` `None` = the default.
pub async fn run(sources: usize, affinity: Option<&str>) -> Result<CacheFigures> {
    let mut mocks = Vec::new();
    for _ in 0..sources {
        let m = MockUpstream::start(MockConfig {
            default: Some(Behavior {
                chunks: answer_chunks(),
                ttft_ms: 20.0,
                ..Behavior::default()
            }),
            record_bodies: false,
            prefix_cache: Some(PrefixCache::new(CacheDialect::Openai)),
            prices: Some(Prices::new(PRICES.0, PRICES.2).with_cached_input(PRICES.1)),
            ..MockConfig::default()
        })
        .await
        .context("starting a simulated upstream with a prompt cache")?;
        mocks.push(m);
    }
    let urls: Vec<String> = mocks.iter().map(|m| m.base_url()).collect();
    let scope = if affinity == Some("off") {
        "CACHE_OFF"
    } else {
        "CACHE_SESSION"
    };
    let client = GatewayClient::from_vars(vars(scope, &urls, affinity), scope)
        .await
        .with_context(|| format!("building the {scope} client"))?;
    let system = system_prompt();
    let mut f = CacheFigures::default();
    for t in 0..TURNS {
        let calls = (0..SESSIONS).map(|s| {
            let (c, r) = (client.clone(), request(&system, s, t));
            async move { c.chat(r).await }
        });
        for r in futures_util::future::join_all(calls).await {
            match r {
                Ok(r) => {
                    let u = r.usage;
                    let cached = u.cached_prompt_tokens.unwrap_or(0);
                    f.prompt_tokens += u.prompt_tokens;
                    f.cached_tokens += cached;
                    f.cost += ((u.prompt_tokens - cached) as f64 * PRICES.0
                        + cached as f64 * PRICES.1
                        + u.completion_tokens as f64 * PRICES.2)
                        / 1e6;
                }
                Err(_) => f.failures += 1,
            }
        }
    }
    client.shutdown().await;
    for m in mocks {
        m.shutdown().await;
    }
    Ok(f)
}

/// The demo's line: both runs side by side.
pub fn line(off: &CacheFigures, on: &CacheFigures) -> String {
    let saving = if off.cost > 0.0 {
        100.0 * (1.0 - on.cost / off.cost)
    } else {
        0.0
    };
    format!(
        "Prompt-cache affinity ({SESSIONS} sessions × {TURNS} turns, a 2 000-token system prompt, \
         upstreams with a prefix cache): cache hit share {:.1} % with AFFINITY=off, {:.1} % \
         with the default (session); cost {:.4} → {:.4} ({saving:.0} % less).",
        off.hit_share(),
        on.hit_share(),
        off.cost,
        on.cost
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_default_reads_more_of_the_prompt_from_the_caches_and_costs_less() {
        let off = run(3, Some("off")).await.unwrap();
        let on = run(3, None).await.unwrap();
        assert_eq!((off.failures, on.failures), (0, 0));
        assert_eq!(off.prompt_tokens, on.prompt_tokens, "the same workload");
        // With affinity every turn after the first finds its prefix on its source.
        assert!(on.cached_tokens > off.cached_tokens, "{off:?} {on:?}");
        assert!(on.cost < off.cost, "{off:?} {on:?}");
        let l = line(&off, &on);
        assert!(l.contains("with the default (session)"), "{l}");
    }
}
