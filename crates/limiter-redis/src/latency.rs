//! [`RedisLatencyStore`]: the scope's live latency distributions shared through Redis
//! (SPEC §19.2), behind core's [`LatencyStore`] port.
//!
//! Keys: `polygw:{S}:lat:<s|p>:<source>:<slot>` — one hash per source, kind (streamed
//! or plain legs) and slot of `window / 10`, under the scope's hash tag (one cluster
//! slot). Fields are the sketches' own (`LatencySketch::to_fields`) prefixed `t` (first
//! token) or `g` (gaps); an exchange adds its deltas with `HINCRBY` into the current slot
//! and reads the last ten slots back, in one pipeline. Counts add up, so every process
//! reads the same merge whatever the order of their exchanges; each hash expires a slot
//! after the window. Slots are numbered by the callers' Unix time (processes' clocks
//! agree to well within a slot, a tenth of the window).

use std::collections::BTreeMap;
use std::time::Duration;

use async_trait::async_trait;
use polygw_core::error::GovernanceError;
use polygw_core::latency::{LatencySketch, LatencySnapshot, SLOTS};
use polygw_core::ports::{LatencyStore, SourceSketch};
use redis::Value;

use crate::{Conn, BACKEND};

/// The shared latency store of a [`crate::RedisGovernance`] (cheap to clone).
#[derive(Debug, Clone)]
pub struct RedisLatencyStore {
    conn: Conn,
}

impl RedisLatencyStore {
    pub(crate) fn new(conn: Conn) -> Self {
        RedisLatencyStore { conn }
    }
}

fn kind(streamed: bool) -> &'static str {
    if streamed {
        "s"
    } else {
        "p"
    }
}

fn slot_key(
    scope: &str,
    streamed: bool,
    source: &str,
    slot: i64,
) -> Result<String, GovernanceError> {
    if scope.is_empty() || scope.contains(['{', '}']) {
        return Err(GovernanceError::new(
            BACKEND,
            format!("scope name {scope:?} cannot be used in a key (empty or has braces)"),
        ));
    }
    Ok(format!(
        "polygw:{{{scope}}}:lat:{}:{source}:{slot}",
        kind(streamed)
    ))
}

/// The fields of a snapshot: the first-token sketch's prefixed `t`, the gaps' `g`.
fn fields(s: &LatencySnapshot) -> Vec<(String, u64)> {
    let mut v: Vec<(String, u64)> = s
        .ttft
        .to_fields()
        .into_iter()
        .map(|(k, n)| (format!("t{k}"), n))
        .collect();
    v.extend(
        s.gap
            .to_fields()
            .into_iter()
            .map(|(k, n)| (format!("g{k}"), n)),
    );
    v
}

/// A snapshot from the fields of several hashes (their counts add up).
fn snapshot(pairs: &[(String, u64)]) -> Result<LatencySnapshot, GovernanceError> {
    let bad = |e: &dyn std::fmt::Display| {
        GovernanceError::new(BACKEND, format!("a latency hash holds a bad field: {e}"))
    };
    let part = |tag: char| {
        LatencySketch::from_fields(
            pairs
                .iter()
                .filter_map(|(k, n)| k.strip_prefix(tag).map(|k| (k, *n))),
        )
    };
    Ok(LatencySnapshot {
        ttft: part('t').map_err(|e| bad(&e))?,
        gap: part('g').map_err(|e| bad(&e))?,
    })
}

#[async_trait]
impl LatencyStore for RedisLatencyStore {
    async fn exchange(
        &self,
        scope: &str,
        now_ms: i64,
        window: Duration,
        deltas: Vec<SourceSketch>,
        sources: Vec<String>,
    ) -> Result<Vec<SourceSketch>, GovernanceError> {
        let slot_ms =
            i64::try_from((window.as_millis() / u128::from(SLOTS)).max(1)).unwrap_or(i64::MAX);
        let current = now_ms.div_euclid(slot_ms);
        let ttl_ms = slot_ms.saturating_mul(SLOTS as i64 + 1);
        let mut pipe = redis::pipe();
        for d in &deltas {
            let key = slot_key(scope, d.streamed, &d.source, current)?;
            for (f, n) in fields(&d.snapshot) {
                pipe.cmd("HINCRBY").arg(&key).arg(f).arg(n).ignore();
            }
            pipe.cmd("PEXPIRE").arg(&key).arg(ttl_ms).ignore();
        }
        let mut reads = Vec::new();
        for streamed in [true, false] {
            for s in &sources {
                for slot in (current - SLOTS as i64 + 1)..=current {
                    pipe.cmd("HGETALL").arg(slot_key(scope, streamed, s, slot)?);
                }
                reads.push((streamed, s.clone()));
            }
        }
        let values: Vec<Value> = self
            .conn
            .query_pipe("exchange latency sketches", &pipe)
            .await?;
        let mut merged: BTreeMap<(bool, String), Vec<(String, u64)>> = BTreeMap::new();
        let per = SLOTS as usize;
        for (i, (streamed, s)) in reads.into_iter().enumerate() {
            let entry = merged.entry((streamed, s)).or_default();
            for v in values.iter().skip(i * per).take(per) {
                let h: Vec<(String, u64)> = redis::from_redis_value(v.clone()).map_err(|e| {
                    GovernanceError::new(BACKEND, format!("a latency hash is not a hash: {e}"))
                })?;
                entry.extend(h);
            }
        }
        let mut out = Vec::new();
        for ((streamed, source), pairs) in merged {
            if pairs.is_empty() {
                continue;
            }
            out.push(SourceSketch {
                streamed,
                source,
                snapshot: snapshot(&pairs)?,
            });
        }
        Ok(out)
    }
}
