//! A served scope ([`Scope`]: a name, its aliases, a chat or an embedding client) and
//! its gate: a cap on the calls running at once with a bounded queue in front of it.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use polygw::{EmbeddingClient, GatewayClient, ScopeClients, ScopeKind};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// The client a scope is served with; its kind decides the endpoint.
#[derive(Debug, Clone)]
pub enum ScopeClient {
    /// Served on `/v1/chat/completions`.
    Chat(GatewayClient),
    /// Served on `/v1/embeddings`.
    Embedding(EmbeddingClient),
}

/// One scope as the proxy serves it. The request's `model` selects it by its name
/// (case-insensitive) or one of its aliases.
#[derive(Debug, Clone)]
pub struct Scope {
    /// The model name clients use (the scope's name, e.g. `LLM`).
    pub name: String,
    /// More model names that select it (`{S}__MODEL_ALIASES`).
    pub aliases: Vec<String>,
    /// The client.
    pub client: ScopeClient,
}

impl Scope {
    /// A chat scope named after the client's settings (name and aliases).
    pub fn chat(client: GatewayClient) -> Scope {
        let s = client.settings();
        Scope {
            name: s.name.clone(),
            aliases: s.model_aliases.clone(),
            client: ScopeClient::Chat(client),
        }
    }

    /// An embedding scope named after the client's settings.
    pub fn embedding(client: EmbeddingClient) -> Scope {
        let s = client.settings();
        Scope {
            name: s.name.clone(),
            aliases: s.model_aliases.clone(),
            client: ScopeClient::Embedding(client),
        }
    }

    /// The scope of `kind` from clients built by `GatewayBuilder::build_all`; `None`
    /// for OCR, which has no OpenAI endpoint.
    pub fn of_kind(kind: ScopeKind, clients: ScopeClients) -> Option<Scope> {
        match kind {
            ScopeKind::Chat => Some(Scope::chat(clients.chat)),
            ScopeKind::Embedding => Some(Scope::embedding(clients.embedding)),
            ScopeKind::Ocr => None,
        }
    }

    /// `chat` or `embedding`.
    pub fn kind(&self) -> ScopeKind {
        match self.client {
            ScopeClient::Chat(_) => ScopeKind::Chat,
            ScopeClient::Embedding(_) => ScopeKind::Embedding,
        }
    }

    /// The scope's source names (for `/healthz`).
    pub fn sources(&self) -> Vec<String> {
        let s = match &self.client {
            ScopeClient::Chat(c) => c.settings(),
            ScopeClient::Embedding(c) => c.settings(),
        };
        s.sources.iter().map(|x| x.name.clone()).collect()
    }

    /// Whether `model` names this scope: its name, an exact alias, or a `*` glob alias
    /// (SPEC §18.3).
    pub fn answers_to(&self, model: &str) -> bool {
        self.names_exactly(model) || self.glob_match(model).is_some()
    }

    /// Whether `model` is the scope's name or one of its aliases without `*`
    /// (case-insensitive).
    pub fn names_exactly(&self, model: &str) -> bool {
        self.name.eq_ignore_ascii_case(model)
            || self
                .aliases
                .iter()
                .any(|a| !a.contains('*') && a.eq_ignore_ascii_case(model))
    }

    /// The length of the longest `*` glob alias that matches `model` (a more specific
    /// pattern wins over a shorter one when several scopes match).
    pub fn glob_match(&self, model: &str) -> Option<usize> {
        self.aliases
            .iter()
            .filter(|a| a.contains('*') && glob_matches(a, model))
            .map(|a| a.len())
            .max()
    }
}

/// Whether `name` matches `pattern`, where `*` stands for any run of characters
/// (ASCII case-insensitive): `claude-*`, `gpt-5*`, `*-mini`, `*`.
pub fn glob_matches(pattern: &str, name: &str) -> bool {
    let p = pattern.to_ascii_lowercase();
    let n = name.to_ascii_lowercase();
    let parts: Vec<&str> = p.split('*').collect();
    let (first, last) = (parts[0], parts[parts.len() - 1]);
    if parts.len() == 1 {
        return p == n;
    }
    if !n.starts_with(first) || n.len() < first.len() + last.len() || !n.ends_with(last) {
        return false;
    }
    let mut rest = &n[first.len()..n.len() - last.len()];
    for mid in &parts[1..parts.len() - 1] {
        match rest.find(mid) {
            Some(i) => rest = &rest[i + mid.len()..],
            None => return false,
        }
    }
    true
}

/// Why the gate turned a call away.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GateRefusal {
    /// The queue was full.
    QueueFull,
    /// The call waited `max_wait` in the queue.
    Waited,
}

/// At most `running` calls of a scope at once, at most `queued` more waiting.
#[derive(Debug)]
pub struct Gate {
    slots: Arc<Semaphore>,
    waiting: AtomicUsize,
    max_waiting: usize,
    /// Calls turned away, for /metrics.
    pub refused: AtomicU64,
}

/// A running call's slot; freed on drop.
#[derive(Debug)]
pub struct Slot(#[allow(dead_code)] OwnedSemaphorePermit);

struct Waiting<'a>(&'a AtomicUsize);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Gate {
    /// A gate of `running` slots and `queued` places.
    pub fn new(running: usize, queued: usize) -> Gate {
        Gate {
            slots: Arc::new(Semaphore::new(running.max(1))),
            waiting: AtomicUsize::new(0),
            max_waiting: queued,
            refused: AtomicU64::new(0),
        }
    }

    /// A slot now, or after waiting at most `max_wait` in the queue.
    pub async fn enter(&self, max_wait: Duration) -> Result<Slot, GateRefusal> {
        if let Ok(p) = self.slots.clone().try_acquire_owned() {
            return Ok(Slot(p));
        }
        let queued = self.waiting.fetch_add(1, Ordering::AcqRel);
        let _w = Waiting(&self.waiting);
        if queued >= self.max_waiting {
            self.refused.fetch_add(1, Ordering::Relaxed);
            return Err(GateRefusal::QueueFull);
        }
        match tokio::time::timeout(max_wait, self.slots.clone().acquire_owned()).await {
            Ok(Ok(p)) => Ok(Slot(p)),
            // The semaphore is never closed; a timeout is the only other way out.
            _ => {
                self.refused.fetch_add(1, Ordering::Relaxed);
                Err(GateRefusal::Waited)
            }
        }
    }

    /// Calls running now.
    pub fn running(&self, capacity: usize) -> usize {
        capacity.max(1) - self.slots.available_permits()
    }

    /// Calls waiting now.
    pub fn waiting(&self) -> usize {
        self.waiting.load(Ordering::Acquire)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn glob_aliases() {
        for (p, n, want) in [
            ("claude-*", "claude-sonnet-4-5", true),
            ("claude-*", "Claude-Opus", true),
            ("claude-*", "claude", false),
            ("gpt-5*", "gpt-5", true),
            ("gpt-5*", "gpt-5.1-codex", true),
            ("gpt-5*", "gpt-4o", false),
            ("*-mini", "o4-mini", true),
            ("a*b*c", "aXbYc", true),
            ("a*b*c", "aXcYb", false),
            ("*", "anything", true),
            ("exact", "EXACT", true),
        ] {
            assert_eq!(glob_matches(p, n), want, "{p} {n}");
        }
    }

    #[tokio::test(start_paused = true)]
    async fn the_gate_caps_running_calls_and_bounds_its_queue() {
        let g = Arc::new(Gate::new(2, 1));
        let a = g.enter(Duration::from_secs(1)).await.unwrap();
        let _b = g.enter(Duration::from_secs(1)).await.unwrap();
        // The third waits in the queue; a fourth finds the queue full at once.
        let g2 = g.clone();
        let third = tokio::spawn(async move { g2.enter(Duration::from_secs(5)).await.map(|_| ()) });
        tokio::task::yield_now().await;
        assert_eq!(g.waiting(), 1);
        assert_eq!(
            g.enter(Duration::from_secs(5)).await.unwrap_err(),
            GateRefusal::QueueFull
        );
        drop(a);
        third.await.unwrap().unwrap();
        assert_eq!(g.waiting(), 0);
        // Waiting longer than max_wait is a refusal too (the paused clock jumps).
        let _c = g.enter(Duration::from_secs(1)).await.unwrap();
        assert_eq!(
            g.enter(Duration::from_secs(2)).await.unwrap_err(),
            GateRefusal::Waited
        );
        assert_eq!(g.refused.load(Ordering::Relaxed), 2);
    }
}
