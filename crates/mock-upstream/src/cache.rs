//! A simulated provider prefix cache (SPEC §20.3): one per mock (one mock = one
//! source), off unless configured. A request's prompt is cut into blocks of
//! `block_tokens` tokens, counted exactly as the mock counts `prompt_tokens`; each block
//! boundary is keyed by a chained hash of everything before it (model, tools, every
//! message's role and fields, text and images). The cached part of a request is the
//! longest run of leading blocks an earlier request wrote within `ttl` (when it is at
//! least `min_tokens`); every request then writes (refreshes) all its full blocks.
//!
//! Time is tokio's clock, so a paused test runtime expires entries with
//! `tokio::time::advance`.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::Value;
use tokio::time::Instant;

use crate::text::{fnv1a_from, mix, FNV_OFFSET};

/// Virtual characters of one image: 85 tokens (OpenAI's low-detail cost) of 4 characters.
const IMAGE_CHARS: u64 = 85 * 4;

/// How a provider reports cached prompt tokens in its usage object.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CacheDialect {
    /// `prompt_tokens_details.cached_tokens` (OpenAI, DashScope/Qwen, vLLM); writes are
    /// free and not reported.
    #[default]
    Openai,
    /// `prompt_cache_hit_tokens` + `prompt_cache_miss_tokens` (DeepSeek), and
    /// `prompt_tokens_details.cached_tokens` too; writes are not reported.
    Deepseek,
    /// `cache_read_input_tokens` + `cache_creation_input_tokens`, both part of
    /// `prompt_tokens` (an OpenAI-compatible Anthropic-style source); writes are billed.
    Anthropic,
}

/// The prefix-cache settings of a mock (`MockConfig::prefix_cache`,
/// `MockUpstream::set_prefix_cache`). JSON: `{"ttl_s", "min_tokens", "block_tokens",
/// "dialect", "hit_ttft_factor", "max_entries"}`, every field optional.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PrefixCache {
    /// How long a written block stays readable after its last write (tokio's clock; a
    /// block is readable while `now − written < ttl`). Default 300 s. JSON `ttl_s`
    /// (seconds, fractions allowed).
    #[serde(rename = "ttl_s", with = "secs")]
    pub ttl: Duration,
    /// The least number of cached tokens a hit reports; a shorter match reports 0, and
    /// a prompt shorter than this is neither read nor written. Default 1024 (OpenAI).
    pub min_tokens: u64,
    /// The cache's granularity: hits are whole blocks of this many tokens. Default 128
    /// (OpenAI). At least 1.
    pub block_tokens: u64,
    /// How usage reports the cache. Default `openai`.
    pub dialect: CacheDialect,
    /// A hit's TTFT is the behavior's `ttft_ms` multiplied by this. Default 0.3.
    pub hit_ttft_factor: f64,
    /// Most blocks kept; the oldest written are evicted first. Default 100 000.
    pub max_entries: usize,
}

impl Default for PrefixCache {
    fn default() -> Self {
        PrefixCache {
            ttl: Duration::from_secs(300),
            min_tokens: 1024,
            block_tokens: 128,
            dialect: CacheDialect::Openai,
            hit_ttft_factor: 0.3,
            max_entries: 100_000,
        }
    }
}

impl PrefixCache {
    /// The default settings (OpenAI's 1024/128 rule, 5 minutes) in `dialect`.
    pub fn new(dialect: CacheDialect) -> Self {
        PrefixCache {
            dialect,
            ..PrefixCache::default()
        }
    }

    /// These settings with another TTL.
    pub fn with_ttl(mut self, ttl: Duration) -> Self {
        self.ttl = ttl;
        self
    }

    /// These settings with another block size and minimum.
    pub fn with_blocks(mut self, block_tokens: u64, min_tokens: u64) -> Self {
        self.block_tokens = block_tokens;
        self.min_tokens = min_tokens;
        self
    }

    /// These settings with another TTFT factor on a hit.
    pub fn with_hit_ttft_factor(mut self, factor: f64) -> Self {
        self.hit_ttft_factor = factor;
        self
    }

    /// Checks what cannot be simulated.
    pub fn validate(&self) -> Result<(), String> {
        if self.block_tokens == 0 {
            return Err("prefix_cache.block_tokens must be ≥ 1".into());
        }
        if !self.hit_ttft_factor.is_finite() || self.hit_ttft_factor < 0.0 {
            return Err(format!(
                "prefix_cache.hit_ttft_factor = {} must be a finite number ≥ 0",
                self.hit_ttft_factor
            ));
        }
        if self.max_entries == 0 {
            return Err("prefix_cache.max_entries must be ≥ 1".into());
        }
        Ok(())
    }
}

mod secs {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    pub(super) fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_f64(d.as_secs_f64())
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        let v = f64::deserialize(d)?;
        Duration::try_from_secs_f64(v).map_err(|_| {
            serde::de::Error::custom(format!("ttl_s = {v} must be a finite number ≥ 0"))
        })
    }
}

/// What the prefix cache did for one request (in [`crate::RecordedRequest`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PromptCacheSeen {
    /// The prompt's tokens as the mock counts them (the `prompt_tokens` it reports
    /// unless the behavior sets its own).
    pub prompt_tokens: u64,
    /// Tokens read from the cache (whole blocks, at least `min_tokens`, else 0).
    pub cached_tokens: u64,
    /// Tokens of the full blocks this request wrote that it did not read:
    /// `written − cached` (what the `anthropic` dialect reports as
    /// `cache_creation_input_tokens`).
    pub cache_write_tokens: u64,
    /// Tokens of every full block the request wrote or refreshed (0 for a prompt
    /// shorter than `min_tokens`).
    pub written_tokens: u64,
    /// The dialect its usage was reported in.
    pub dialect: CacheDialect,
}

/// The prompt's token count and the keys of its block boundaries (`keys[k]` = every
/// virtual character before the end of block `k`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Blocks {
    pub(crate) tokens: u64,
    pub(crate) keys: Vec<u64>,
}

struct Hasher {
    state: u64,
    /// Virtual characters so far.
    pos: u64,
    block_chars: u64,
    keys: Vec<u64>,
}

impl Hasher {
    fn bytes(&mut self, b: &[u8]) {
        self.state = fnv1a_from(self.state, b);
    }

    /// Advances `n` virtual characters after hashing `content` (text: one character;
    /// an image: its URL once), recording each block boundary reached.
    fn advance(&mut self, n: u64) {
        let end = self.pos + n;
        let mut next = (self.pos / self.block_chars + 1) * self.block_chars;
        while next <= end {
            let k = next / self.block_chars;
            self.keys.push(mix(self.state ^ mix(k)));
            next += self.block_chars;
        }
        self.pos = end;
    }

    fn text(&mut self, s: &str) {
        let mut buf = [0u8; 4];
        for c in s.chars() {
            self.bytes(c.encode_utf8(&mut buf).as_bytes());
            self.advance(1);
        }
    }
}

/// Cuts a request body into blocks of `block_tokens` tokens. Tokens are counted as
/// [`crate::text::prompt_tokens`] counts them: every 4 characters of message text
/// (`content` strings and the `text` of content parts) are one token and every
/// `image_url` part is 85 tokens (340 virtual characters, at its place). The hash also
/// covers, without tokens of their own: the request's `model` and `tools` (first, as
/// providers put tools before the messages), and per message, where it starts, its
/// role and every other field but `content` (`name`, `tool_calls`, `tool_call_id`, a
/// prefill marker…).
pub(crate) fn blocks(body: &Value, block_tokens: u64) -> Blocks {
    let mut h = Hasher {
        state: FNV_OFFSET,
        pos: 0,
        block_chars: block_tokens.max(1) * 4,
        keys: Vec::new(),
    };
    h.bytes(b"model\0");
    if let Some(m) = body.get("model").and_then(Value::as_str) {
        h.bytes(m.as_bytes());
    }
    h.bytes(b"\0tools\0");
    if let Some(t) = body.get("tools") {
        h.bytes(t.to_string().as_bytes());
    }
    let mut images = 0u64;
    let mut chars = 0u64;
    if let Some(msgs) = body.get("messages").and_then(Value::as_array) {
        for m in msgs {
            h.bytes(b"\0message\0");
            if let Some(obj) = m.as_object() {
                for (k, v) in obj {
                    if k != "content" {
                        h.bytes(k.as_bytes());
                        h.bytes(b"=");
                        h.bytes(v.to_string().as_bytes());
                        h.bytes(b"\0");
                    }
                }
            }
            h.bytes(b"\0content\0");
            match m.get("content") {
                Some(Value::String(s)) => {
                    chars += s.chars().count() as u64;
                    h.text(s);
                }
                Some(Value::Array(parts)) => {
                    for p in parts {
                        h.bytes(b"\0part\0");
                        if let Some(t) = p.get("text").and_then(Value::as_str) {
                            chars += t.chars().count() as u64;
                            h.text(t);
                        }
                        if p.get("type").and_then(Value::as_str) == Some("image_url") {
                            images += 1;
                            h.bytes(b"\0image\0");
                            if let Some(u) = p.get("image_url") {
                                h.bytes(u.to_string().as_bytes());
                            }
                            h.advance(IMAGE_CHARS);
                        }
                    }
                }
                _ => {}
            }
        }
    }
    Blocks {
        tokens: chars.div_ceil(4).max(1) + 85 * images,
        keys: h.keys,
    }
}

/// The cache figures a response reports (clamped to the reported prompt tokens).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct CacheUse {
    pub(crate) dialect: CacheDialect,
    pub(crate) cached: u64,
    pub(crate) write: u64,
}

impl CacheUse {
    /// The figures for a response reporting `prompt` tokens: `cached ≤ prompt`,
    /// `write ≤ prompt − cached`.
    pub(crate) fn clamped(self, prompt: u64) -> CacheUse {
        let cached = self.cached.min(prompt);
        CacheUse {
            cached,
            write: self.write.min(prompt - cached),
            ..self
        }
    }

    /// `Usage.cache_write_tokens` as polygw's transport parses this dialect: only
    /// `anthropic` reports writes.
    pub(crate) fn reported_write(&self) -> Option<u64> {
        (self.dialect == CacheDialect::Anthropic).then_some(self.write)
    }
}

/// The outcome of a lookup: tokens read and tokens of full blocks written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct Lookup {
    pub(crate) cached: u64,
    pub(crate) written: u64,
}

/// The blocks a mock's cache holds: key → (last write, write sequence), plus the keys
/// in write order for expiry and eviction (oldest first).
#[derive(Debug, Default)]
pub(crate) struct Store {
    map: HashMap<u64, (Instant, u64)>,
    order: BTreeMap<u64, u64>,
    seq: u64,
}

impl Store {
    pub(crate) fn len(&self) -> usize {
        self.map.len()
    }

    pub(crate) fn clear(&mut self) {
        self.map.clear();
        self.order.clear();
    }

    fn expire(&mut self, now: Instant, ttl: Duration) {
        while let Some((&seq, &key)) = self.order.first_key_value() {
            let at = self.map.get(&key).map(|e| e.0);
            match at {
                Some(at) if now.saturating_duration_since(at) < ttl => break,
                _ => {
                    self.order.remove(&seq);
                    self.map.remove(&key);
                }
            }
        }
    }

    /// Reads the longest cached run of `blocks`' leading blocks, then writes all of
    /// them (a prompt shorter than `min_tokens` does neither).
    pub(crate) fn lookup_and_write(
        &mut self,
        cfg: &PrefixCache,
        blocks: &Blocks,
        now: Instant,
    ) -> Lookup {
        self.expire(now, cfg.ttl);
        if blocks.tokens < cfg.min_tokens || blocks.keys.is_empty() {
            return Lookup::default();
        }
        let matched = blocks
            .keys
            .iter()
            .take_while(|k| self.map.contains_key(k))
            .count() as u64;
        let b = cfg.block_tokens.max(1);
        let cached = if matched * b >= cfg.min_tokens {
            matched * b
        } else {
            0
        };
        // Deepest block first, so the first block is the newest: eviction (oldest
        // first) then shortens prefixes instead of breaking them.
        for key in blocks.keys.iter().rev() {
            self.seq += 1;
            if let Some((_, old)) = self.map.insert(*key, (now, self.seq)) {
                self.order.remove(&old);
            }
            self.order.insert(self.seq, *key);
        }
        while self.map.len() > cfg.max_entries.max(1) {
            match self.order.pop_first() {
                Some((_, key)) => {
                    self.map.remove(&key);
                }
                None => break,
            }
        }
        Lookup {
            cached,
            written: blocks.keys.len() as u64 * b,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn conv(turns: &[(&str, String)]) -> Value {
        let msgs: Vec<Value> = turns
            .iter()
            .map(|(r, c)| json!({"role": r, "content": c}))
            .collect();
        json!({"model": "m", "messages": msgs})
    }

    fn cfg(block: u64, min: u64) -> PrefixCache {
        PrefixCache::default().with_blocks(block, min)
    }

    #[test]
    fn the_count_is_the_mocks_prompt_token_count() {
        let bodies = [
            json!({}),
            conv(&[("user", "x".repeat(7))]),
            conv(&[("system", "é".repeat(4097)), ("user", "abc".into())]),
            json!({"messages": [{"role": "user", "content": [
                {"type": "text", "text": "look"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                {"type": "text", "text": "at it"}]}]}),
        ];
        for b in &bodies {
            let images = crate::text::images_of(b).len();
            let blocks = blocks(b, 16);
            assert_eq!(blocks.tokens, crate::text::prompt_tokens(b, images), "{b}");
        }
        // 4097·2-byte characters = 1025 tokens: 8 full blocks of 128.
        assert_eq!(blocks(&bodies[2], 128).keys.len(), 8);
        // An image is 85 tokens at its place: 1 + 85 + 2 = 88 tokens → 5 blocks of 16.
        assert_eq!(blocks(&bodies[3], 16).keys.len(), 5);
    }

    #[test]
    fn keys_are_prefixes_and_cover_roles_tools_and_model() {
        let s = "s".repeat(600);
        let a = conv(&[("system", s.clone()), ("user", "q".repeat(100))]);
        let b = conv(&[
            ("system", s.clone()),
            ("user", "q".repeat(100)),
            ("assistant", "a".repeat(300)),
        ]);
        let (ka, kb) = (blocks(&a, 16).keys, blocks(&b, 16).keys);
        assert_eq!(ka.len(), 700 / 64);
        assert_eq!(
            kb[..ka.len()],
            ka[..],
            "a longer conversation extends the keys"
        );
        // The same characters under another role, or split otherwise, differ where
        // the difference starts.
        let other_role = conv(&[("user", s.clone()), ("user", "q".repeat(100))]);
        assert_ne!(blocks(&other_role, 16).keys[0], ka[0]);
        let split = conv(&[("system", s.clone() + "q"), ("user", "q".repeat(99))]);
        let ks = blocks(&split, 16).keys;
        assert_eq!(
            ks[..9],
            ka[..9],
            "600 chars = 9 full blocks before the split"
        );
        assert_ne!(ks[9], ka[9]);
        let mut tools = a.clone();
        tools["tools"] = json!([{"type": "function", "function": {"name": "f"}}]);
        assert_ne!(blocks(&tools, 16).keys[0], ka[0]);
        let mut model = a.clone();
        model["model"] = json!("other");
        assert_ne!(blocks(&model, 16).keys[0], ka[0]);
    }

    #[test]
    fn longest_prefix_min_tokens_and_writes() {
        let c = cfg(16, 64);
        let now = Instant::now();
        let mut st = Store::default();
        let s = "s".repeat(400); // 100 tokens: 6 full blocks
        let t1 = conv(&[("system", s.clone()), ("user", "u".repeat(40))]); // 110 → 6
        let t2 = conv(&[
            ("system", s.clone()),
            ("user", "u".repeat(40)),
            ("assistant", "a".repeat(200)),
            ("user", "v".repeat(40)),
        ]); // 170 tokens → 10 blocks
        assert_eq!(
            st.lookup_and_write(&c, &blocks(&t1, 16), now),
            Lookup {
                cached: 0,
                written: 96
            }
        );
        assert_eq!(st.len(), 6);
        assert_eq!(
            st.lookup_and_write(&c, &blocks(&t2, 16), now),
            Lookup {
                cached: 96,
                written: 160
            }
        );
        assert_eq!(st.len(), 10);
        // A prompt that shares only 3 blocks (48 < 64 tokens) reads nothing.
        let t3 = conv(&[("system", "s".repeat(200) + &"x".repeat(200))]);
        assert_eq!(st.lookup_and_write(&c, &blocks(&t3, 16), now).cached, 0);
        // A prompt under min_tokens neither reads nor writes.
        let before = st.len();
        let short = conv(&[("system", "s".repeat(200))]);
        assert_eq!(
            st.lookup_and_write(&c, &blocks(&short, 16), now),
            Lookup::default()
        );
        assert_eq!(st.len(), before);
    }

    #[test]
    fn ttl_counts_from_the_last_write_on_tokios_clock() {
        let c = cfg(16, 16).with_ttl(Duration::from_secs(10));
        let t0 = Instant::now();
        let mut st = Store::default();
        let b = blocks(&conv(&[("user", "z".repeat(256))]), 16); // 64 tokens: 4 blocks
        assert_eq!(st.lookup_and_write(&c, &b, t0).cached, 0);
        let at = |s: u64| t0 + Duration::from_secs(s);
        assert_eq!(st.lookup_and_write(&c, &b, at(9)).cached, 64, "within ttl");
        // Refreshed at 9 s: still there at 18 s, gone at 28 s (10 s after 18 s).
        assert_eq!(st.lookup_and_write(&c, &b, at(18)).cached, 64);
        assert_eq!(
            st.lookup_and_write(&c, &b, at(28)).cached,
            0,
            "ttl is exclusive"
        );
        assert_eq!(st.len(), 4, "expired blocks are dropped, then rewritten");
    }

    #[test]
    fn memory_is_bounded_and_eviction_shortens_prefixes() {
        let c = PrefixCache {
            max_entries: 5,
            ..cfg(16, 16)
        };
        let now = Instant::now();
        let mut st = Store::default();
        let a = blocks(&conv(&[("user", "a".repeat(64 * 4))]), 16); // 4 blocks
        let b = blocks(&conv(&[("user", "b".repeat(64 * 4))]), 16); // 4 blocks
        st.lookup_and_write(&c, &a, now);
        st.lookup_and_write(&c, &b, now);
        assert_eq!(st.len(), 5);
        // a's deepest blocks went first: its first block is left.
        assert_eq!(st.lookup_and_write(&c, &a, now).cached, 16);
        for i in 0..1000 {
            let x = blocks(&conv(&[("user", format!("{i:08}").repeat(40))]), 16);
            st.lookup_and_write(&c, &x, now);
            assert!(st.len() <= 5);
        }
    }

    #[test]
    fn json_format() {
        let p: PrefixCache = serde_json::from_value(json!({})).unwrap();
        assert_eq!(p, PrefixCache::default());
        let p: PrefixCache = serde_json::from_value(json!({
            "ttl_s": 0.5, "min_tokens": 64, "block_tokens": 64, "dialect": "deepseek",
            "hit_ttft_factor": 0.25, "max_entries": 10
        }))
        .unwrap();
        assert_eq!(p.ttl, Duration::from_millis(500));
        assert_eq!(p.dialect, CacheDialect::Deepseek);
        let back: PrefixCache = serde_json::from_value(serde_json::to_value(&p).unwrap()).unwrap();
        assert_eq!(back, p);
        assert!(serde_json::from_value::<PrefixCache>(json!({"ttl_s": -1})).is_err());
        assert!(serde_json::from_value::<PrefixCache>(json!({"ttl": 1})).is_err());
        assert!(serde_json::from_value::<PrefixCache>(json!({"dialect": "x"})).is_err());
        assert!(PrefixCache::default().with_blocks(0, 0).validate().is_err());
        assert!(PrefixCache::default().validate().is_ok());
    }
}
