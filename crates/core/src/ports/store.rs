//! The `ResponseStore` port (SPEC §18.1, §24.5): stored OpenAI Responses (`store: true`),
//! so that `previous_response_id`, `GET` and `DELETE /v1/responses/{id}` work — in the
//! scope's telemetry database (SQLite or PostgreSQL), or a bounded in-process store
//! when the scope has none. Entries expire (`RESPONSES__TTL_S`).
//!
//! A stored response is one turn: its own input items, its answer, and a link to the
//! turn it continues (`previous_id`), so that storage grows with the turn, not with the
//! conversation (SPEC §24.5). [`conversation`] rebuilds what a continuation extends from
//! a [`ResponseStore::chain`]; a chain with a missing turn is a [`BrokenChain`], never a
//! shorter conversation.

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::error::TelemetryError;

/// Turns one conversation holds at most: a chain deeper than this is refused as broken
/// (and a cycle that corrupt data could make ends here).
pub const MAX_TURNS: usize = 10_000;

/// Bytes a stored entry counts besides its JSON text and ids (map and index nodes,
/// string headers, row overhead), so that many tiny entries are bounded too.
pub const ENTRY_OVERHEAD: u64 = 160;

/// One stored turn of a conversation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StoredResponse {
    /// The response id (`resp_…`).
    pub id: String,
    /// Whose it is: the scope that answered it, and the client key that asked
    /// (`SCOPE/key_…`); a lookup by another owner does not see it, and the owner's
    /// entries are bounded together (`RESPONSES__MAX_BYTES_PER_KEY`).
    pub scope: String,
    /// The `response` object as answered.
    pub response: Value,
    /// This turn's input items: what its request sent after the turns it continues.
    pub input_items: Vec<Value>,
    /// The stored response this one continues (its request's `previous_response_id`).
    pub previous_id: Option<String>,
    /// When it was stored (Unix ms).
    pub created_at_ms: i64,
    /// When it expires (Unix ms).
    pub expires_at_ms: i64,
}

/// The bytes an entry counts against its owner's bound, from the lengths of the JSON
/// text of its response and input items: the same figure in every store.
pub fn entry_bytes(r: &StoredResponse, response_json: usize, items_json: usize) -> u64 {
    let ids = r.id.len() + r.previous_id.as_ref().map_or(0, String::len);
    (ids + response_json + items_json) as u64 + ENTRY_OVERHEAD
}

/// Stores responses by id.
#[cfg_attr(any(test, feature = "mock"), mockall::automock)]
#[async_trait]
pub trait ResponseStore: Send + Sync + std::fmt::Debug {
    /// Stores (or replaces) `r`; renews the expiry of the live turns it continues (its
    /// `previous_id` chain, up to [`MAX_TURNS`]) to `r.expires_at_ms` when that is
    /// later, so that a conversation in use does not lose its first turns; then keeps
    /// `r.scope`'s entries within `max_bytes` ([`entry_bytes`] each) by removing those
    /// of that owner that expire soonest — never `r`, never another owner's. An `r`
    /// larger than `max_bytes` on its own is refused (an error), and nothing changes.
    async fn put(&self, r: StoredResponse, max_bytes: u64) -> Result<(), TelemetryError>;
    /// The response `id` of `scope`, unless it expired before `now_ms` or was deleted.
    async fn get(
        &self,
        scope: &str,
        id: &str,
        now_ms: i64,
    ) -> Result<Option<StoredResponse>, TelemetryError>;
    /// The response `id` of `scope` and the turns it continues, newest first, as far as
    /// they are stored and live at `now_ms` (at most [`MAX_TURNS`]); empty when `id` is
    /// not. [`conversation`] says whether it is whole.
    async fn chain(
        &self,
        scope: &str,
        id: &str,
        now_ms: i64,
    ) -> Result<Vec<StoredResponse>, TelemetryError> {
        let mut out: Vec<StoredResponse> = Vec::new();
        let mut next = Some(id.to_string());
        while let Some(id) = next.take() {
            if out.len() >= MAX_TURNS {
                break;
            }
            match self.get(scope, &id, now_ms).await? {
                Some(r) => {
                    next = r.previous_id.clone();
                    out.push(r);
                }
                None => break,
            }
        }
        Ok(out)
    }
    /// Deletes it; whether it was there.
    async fn delete(&self, scope: &str, id: &str) -> Result<bool, TelemetryError>;
}

/// A conversation that cannot be rebuilt: the turn `missing` (which `after` continues)
/// expired, was deleted or evicted, or the chain is deeper than [`MAX_TURNS`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BrokenChain {
    /// The stored turn whose predecessor is gone.
    pub after: String,
    /// The id it names as its predecessor.
    pub missing: String,
}

impl std::fmt::Display for BrokenChain {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "the stored response '{}' continues '{}', which is no longer stored (it \
             expired, was deleted, or was evicted by RESPONSES__MAX_BYTES_PER_KEY)",
            self.after, self.missing
        )
    }
}

/// Checks that `chain` (newest first, as [`ResponseStore::chain`] returns it) is whole:
/// each turn continues the next, and the oldest continues nothing.
fn whole(chain: &[StoredResponse]) -> Result<(), BrokenChain> {
    for (i, turn) in chain.iter().enumerate() {
        match (&turn.previous_id, chain.get(i + 1)) {
            (None, _) => {
                if i + 1 == chain.len() {
                    return Ok(());
                }
                // A turn that continues nothing, with more after it: not a chain the
                // store returns; treated as broken rather than joined.
                return Err(BrokenChain {
                    after: chain[i + 1].id.clone(),
                    missing: turn.id.clone(),
                });
            }
            (Some(prev), Some(older)) if *prev == older.id => {}
            (Some(prev), _) => {
                return Err(BrokenChain {
                    after: turn.id.clone(),
                    missing: prev.clone(),
                })
            }
        }
    }
    Ok(())
}

/// What a request that continues `chain[0]` extends: every turn's input items then its
/// output items, oldest turn first. Empty for an empty chain.
pub fn conversation(chain: &[StoredResponse]) -> Result<Vec<Value>, BrokenChain> {
    whole(chain)?;
    let mut out = Vec::new();
    for turn in chain.iter().rev() {
        out.extend(turn.input_items.iter().cloned());
        out.extend(output_items(turn).iter().cloned());
    }
    Ok(out)
}

/// The input items `chain[0]` answered: the turns before it (their inputs and outputs),
/// then its own input (`GET /v1/responses/{id}/input_items`).
pub fn answered_input(chain: &[StoredResponse]) -> Result<Vec<Value>, BrokenChain> {
    whole(chain)?;
    let Some((newest, older)) = chain.split_first() else {
        return Ok(Vec::new());
    };
    let mut out = conversation(older)?;
    out.extend(newest.input_items.iter().cloned());
    Ok(out)
}

fn output_items(r: &StoredResponse) -> &[Value] {
    r.response
        .get("output")
        .and_then(Value::as_array)
        .map_or(&[], Vec::as_slice)
}

/// A store that keeps nothing (a scope whose responses are never stored).
#[derive(Debug, Clone, Copy, Default)]
pub struct NullStore;

#[async_trait]
impl ResponseStore for NullStore {
    async fn put(&self, _r: StoredResponse, _max_bytes: u64) -> Result<(), TelemetryError> {
        Ok(())
    }
    async fn get(
        &self,
        _scope: &str,
        _id: &str,
        _now_ms: i64,
    ) -> Result<Option<StoredResponse>, TelemetryError> {
        Ok(None)
    }
    async fn delete(&self, _scope: &str, _id: &str) -> Result<bool, TelemetryError> {
        Ok(false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ports::block_on;
    use serde_json::json;

    fn turn(id: &str, prev: Option<&str>) -> StoredResponse {
        StoredResponse {
            id: id.into(),
            scope: "S".into(),
            response: json!({"id": id, "output": [{"type": "message", "text": format!("out {id}")}]}),
            input_items: vec![json!({"role": "user", "content": format!("in {id}")})],
            previous_id: prev.map(str::to_string),
            created_at_ms: 0,
            expires_at_ms: 1,
        }
    }

    fn texts(items: &[Value]) -> Vec<String> {
        items
            .iter()
            .map(|v| {
                v.get("content")
                    .or_else(|| v.get("text"))
                    .and_then(Value::as_str)
                    .unwrap_or_default()
                    .to_string()
            })
            .collect()
    }

    #[test]
    fn a_whole_chain_is_the_conversation_oldest_first() {
        let chain = [turn("c", Some("b")), turn("b", Some("a")), turn("a", None)];
        assert_eq!(
            texts(&conversation(&chain).unwrap()),
            ["in a", "out a", "in b", "out b", "in c", "out c"]
        );
        assert_eq!(
            texts(&answered_input(&chain).unwrap()),
            ["in a", "out a", "in b", "out b", "in c"]
        );
        assert!(conversation(&[]).unwrap().is_empty());
        assert!(answered_input(&[]).unwrap().is_empty());
    }

    #[test]
    fn a_missing_turn_breaks_the_chain_and_names_it() {
        // The store stopped at b: a is gone.
        let chain = [turn("c", Some("b")), turn("b", Some("a"))];
        let e = conversation(&chain).unwrap_err();
        assert_eq!((e.after.as_str(), e.missing.as_str()), ("b", "a"));
        assert!(e.to_string().contains("'a'"), "{e}");
        assert_eq!(answered_input(&chain).unwrap_err(), e);
        // A chain that does not link up is broken too, never joined.
        let skew = [turn("c", Some("x")), turn("b", None)];
        assert_eq!(conversation(&skew).unwrap_err().missing, "x");
        let early_root = [turn("c", None), turn("b", None)];
        assert!(conversation(&early_root).is_err());
    }

    #[test]
    fn entry_bytes_count_ids_json_and_overhead() {
        let mut r = turn("resp_1", Some("resp_0"));
        assert_eq!(entry_bytes(&r, 100, 20), 6 + 6 + 120 + ENTRY_OVERHEAD);
        r.previous_id = None;
        assert_eq!(entry_bytes(&r, 0, 0), 6 + ENTRY_OVERHEAD);
    }

    /// A store that only answers `get`, from a fixed set: the trait's own `chain`.
    #[derive(Debug)]
    struct Fixed(Vec<StoredResponse>);

    #[async_trait]
    impl ResponseStore for Fixed {
        async fn put(&self, _: StoredResponse, _: u64) -> Result<(), TelemetryError> {
            Ok(())
        }
        async fn get(
            &self,
            _: &str,
            id: &str,
            _: i64,
        ) -> Result<Option<StoredResponse>, TelemetryError> {
            Ok(self.0.iter().find(|r| r.id == id).cloned())
        }
        async fn delete(&self, _: &str, _: &str) -> Result<bool, TelemetryError> {
            Ok(false)
        }
    }

    #[test]
    fn the_default_chain_follows_links_and_stops_at_a_gap() {
        let s = Fixed(vec![turn("c", Some("b")), turn("b", Some("a"))]);
        let chain = block_on(s.chain("S", "c", 0)).unwrap();
        let ids: Vec<_> = chain.iter().map(|r| r.id.as_str()).collect();
        assert_eq!(ids, ["c", "b"]);
        assert_eq!(conversation(&chain).unwrap_err().missing, "a");
        assert!(block_on(s.chain("S", "zz", 0)).unwrap().is_empty());
        // A cycle (corrupt data) ends at MAX_TURNS, and is broken.
        let cyc = Fixed(vec![turn("x", Some("y")), turn("y", Some("x"))]);
        let chain = block_on(cyc.chain("S", "x", 0)).unwrap();
        assert_eq!(chain.len(), MAX_TURNS);
        assert!(conversation(&chain).is_err());
    }
}
