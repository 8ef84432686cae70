//! The work that runs beside the calls: the queue of settlements and releases that could
//! not be awaited (SPEC §14.5) and the heartbeat that renews live leases (SPEC §14.4).
//!
//! **Queue.** Bounded ([`crate::RedisOptions::queue_capacity`]). One task applies the jobs
//! in order; a job that fails is retried with backoff (50 ms doubling up to
//! [`crate::RedisOptions::max_backoff`], with jitter) until it lands — nothing queued is
//! discarded while the governance lives, so a slot held by a hedge loser or a cancelled
//! call frees as soon as Redis is back. A job that does not fit is counted
//! ([`Background::dropped`]) and logged (at most once per 10 s, with the count since);
//! its slot ends with its lease (its heartbeat stopped when it was queued). Once every
//! handle and permit is gone the task drains what is left, gives a failing job up after
//! [`crate::RedisOptions::settle_attempts`] tries (counted, logged) and ends.
//!
//! **Heartbeat.** Live permits and probes are registered here; a task started with the
//! first one renews them all every third of the shortest lease, one script per scope
//! (a scope's keys share a cluster slot). It stops when the governance's last handle is
//! dropped or on [`Background::stop_heartbeat`]. A lease that ended before its renewal
//! (Redis unreachable for a whole lease) is not revived: it is dropped from the registry
//! and logged.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Mutex, MutexGuard};
use std::time::Duration;

use polygw_core::error::GovernanceError;
use redis::Script;
use tokio::sync::{mpsc, oneshot, Notify};
use tokio::time::Instant;

use crate::client_keys::{self, KeyFinish};
use crate::keys::{self, SourceKeys};
use crate::{exact, Conn, BACKEND};

static SETTLE: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("lua/settle.lua")));
static RECORD: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("lua/breaker_record.lua")));
static RELEASE: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("lua/breaker_release.lua")));
static RENEW: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("lua/renew.lua")));

/// How often a repeated warning is logged at most.
const LOG_EVERY: Duration = Duration::from_secs(10);

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A settlement (and/or release) of one permit.
#[derive(Debug, Clone)]
pub(crate) struct Settlement {
    pub keys: SourceKeys,
    pub id: String,
    /// The permit's reservation (part of its ledger entry's name).
    pub est: u64,
    pub tokens: Option<u64>,
    pub release: bool,
}

/// Work the queue applies.
#[derive(Debug, Clone)]
pub(crate) enum Work {
    Settle(Box<Settlement>),
    /// Finishes a client key's permit (settle and release).
    FinishKey(Box<KeyFinish>),
    /// Frees the probe an admission got if its answer was lost (by the admission's token).
    ReleaseProbeByToken {
        key: String,
        token: String,
    },
    /// Frees the probe admitted under `epoch` (a neutral record).
    ReleaseProbe {
        key: String,
        epoch: u64,
    },
}

enum Job {
    Work(Work),
    /// Answered once every job queued before it is done.
    Flush(oneshot::Sender<()>),
}

/// Counters shared by the handles and the queue task (which must not keep the sender
/// alive, or it would never end).
#[derive(Default)]
struct Counters {
    /// Accepted and not applied (or given up) yet.
    pending: AtomicU64,
    /// Could not be queued (queue full) since the start.
    dropped: AtomicU64,
    /// Dropped since the last flush (reported by it).
    dropped_since_flush: AtomicU64,
    /// Given up after the governance was gone.
    lost: AtomicU64,
    last_error: Mutex<Option<String>>,
    /// When the overflow warning was last logged, and how many since.
    overflow_log: Mutex<(Option<Instant>, u64)>,
}

/// One lease the heartbeat renews.
#[derive(Debug, Clone)]
pub(crate) struct Lease {
    /// The scope, or the client key's id (`LeaseKind::Key`).
    pub scope: String,
    pub source: String,
    pub kind: LeaseKind,
    pub lease_ms: u64,
}

/// What a lease is.
#[derive(Debug, Clone)]
pub(crate) enum LeaseKind {
    /// A permit's slot and reservation (of `est` tokens).
    Permit { id: String, est: u64 },
    /// A half-open probe admitted under this epoch.
    Probe { epoch: u64 },
    /// A client key's permit: its slot and its money (`nanos`) and token (`est`)
    /// reservations.
    Key { id: String, nanos: u64, est: u64 },
}

#[derive(Default)]
struct Beat {
    leases: HashMap<u64, Lease>,
    next: u64,
    started: bool,
    stopped: bool,
}

/// The queue and the heartbeat of one governance.
pub(crate) struct Background {
    conn: Conn,
    tx: mpsc::Sender<Job>,
    counters: Arc<Counters>,
    beat: Mutex<Beat>,
    /// Wakes the heartbeat task (a lease was registered, or it must stop).
    wake: Notify,
    stopped: AtomicBool,
}

impl std::fmt::Debug for Background {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Background")
            .field("conn", &self.conn)
            .field("pending", &self.counters.pending.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

impl Background {
    /// The queue task starts now, on the current runtime; the heartbeat with its first lease.
    pub(crate) fn start(conn: Conn) -> Arc<Background> {
        let (tx, rx) = mpsc::channel(conn.opts.queue_capacity.max(1));
        let counters = Arc::new(Counters::default());
        tokio::spawn(drain(conn.clone(), rx, counters.clone()));
        Arc::new(Background {
            conn,
            tx,
            counters,
            beat: Mutex::new(Beat::default()),
            wake: Notify::new(),
            stopped: AtomicBool::new(false),
        })
    }

    pub(crate) fn conn(&self) -> &Conn {
        &self.conn
    }

    /// Queues work without blocking; counts and logs it when the queue is full.
    pub(crate) fn enqueue(&self, work: Work) {
        self.counters.pending.fetch_add(1, Ordering::AcqRel);
        if let Err(e) = self.tx.try_send(Job::Work(work)) {
            self.counters.pending.fetch_sub(1, Ordering::AcqRel);
            self.counters.dropped.fetch_add(1, Ordering::AcqRel);
            self.counters
                .dropped_since_flush
                .fetch_add(1, Ordering::AcqRel);
            let closed = matches!(e, mpsc::error::TrySendError::Closed(_));
            let mut log = lock(&self.counters.overflow_log);
            log.1 += 1;
            let now = Instant::now();
            if log.0.is_none_or(|t| now.duration_since(t) >= LOG_EVERY) {
                tracing::warn!(
                    dropped = log.1,
                    total_dropped = self.counters.dropped.load(Ordering::Relaxed),
                    capacity = self.conn.opts.queue_capacity,
                    queue_task_gone = closed,
                    "governance settlement queue full: settlements/releases dropped; their slots free when their leases end"
                );
                *log = (Some(now), 0);
            }
        }
    }

    /// Settlements and releases that could not be queued since the start.
    pub(crate) fn dropped(&self) -> u64 {
        self.counters.dropped.load(Ordering::Acquire)
    }

    /// Waits until everything queued before this call is applied, within the flush
    /// timeout. Errors if some is still waiting (Redis failing) or some was dropped or
    /// given up since the last flush.
    pub(crate) async fn flush(&self) -> Result<(), GovernanceError> {
        let limit = self.conn.opts.flush_timeout;
        let (tx, rx) = oneshot::channel();
        let done = async { self.tx.send(Job::Flush(tx)).await.is_ok() && rx.await.is_ok() };
        let drained = tokio::time::timeout(limit, done).await.unwrap_or(false);
        let dropped = self.counters.dropped_since_flush.swap(0, Ordering::AcqRel);
        let lost = self.counters.lost.swap(0, Ordering::AcqRel);
        let mut problems = vec![];
        if !drained {
            let pending = self.counters.pending.load(Ordering::Acquire);
            let last = lock(&self.counters.last_error).clone().unwrap_or_default();
            problems.push(format!(
                "{pending} queued settlement(s) not applied within {limit:?} (they are retried \
                 in the background); last error: {last}"
            ));
        }
        if dropped > 0 {
            problems.push(format!(
                "{dropped} settlement(s) dropped because the queue was full (capacity {}); \
                 their slots free when their leases end",
                self.conn.opts.queue_capacity
            ));
        }
        if lost > 0 {
            problems.push(format!("{lost} settlement(s) given up"));
        }
        if problems.is_empty() {
            Ok(())
        } else {
            Err(GovernanceError::new(BACKEND, problems.join("; ")))
        }
    }

    /// Registers a lease with the heartbeat (started on the first one). `None` once the
    /// heartbeat is stopped: the lease then ends on its own.
    pub(crate) fn register(self: &Arc<Self>, lease: Lease) -> Option<u64> {
        let mut b = lock(&self.beat);
        if b.stopped {
            return None;
        }
        b.next += 1;
        let id = b.next;
        b.leases.insert(id, lease);
        if !b.started {
            if let Ok(rt) = tokio::runtime::Handle::try_current() {
                b.started = true;
                rt.spawn(heartbeat(self.clone()));
            }
        }
        drop(b);
        self.wake.notify_one();
        Some(id)
    }

    pub(crate) fn deregister(&self, id: Option<u64>) {
        if let Some(id) = id {
            lock(&self.beat).leases.remove(&id);
        }
    }

    /// Stops renewing (idempotent); the heartbeat task ends.
    pub(crate) fn stop_heartbeat(&self) {
        {
            let mut b = lock(&self.beat);
            b.stopped = true;
            b.leases.clear();
        }
        self.stopped.store(true, Ordering::Release);
        self.wake.notify_one();
    }

    /// Live leases registered (tests).
    #[cfg(test)]
    pub(crate) fn leases(&self) -> usize {
        lock(&self.beat).leases.len()
    }
}

async fn apply(conn: &Conn, work: &Work) -> Result<(), GovernanceError> {
    match work {
        Work::Settle(s) => settle(conn, s).await,
        Work::FinishKey(f) => client_keys::finish(conn, f).await,
        Work::ReleaseProbeByToken { key, token } => {
            let mut inv = RELEASE.prepare_invoke();
            inv.key(key).arg(token);
            let _: i64 = conn.run("breaker probe release", &inv).await?;
            Ok(())
        }
        Work::ReleaseProbe { key, epoch } => {
            let mut inv = RECORD.prepare_invoke();
            inv.key(key)
                .arg("neutral")
                .arg("1")
                .arg(0)
                .arg(1)
                .arg(1)
                .arg(1)
                .arg(exact(crate::ms(conn.opts.breaker_idle_ttl)).max(1))
                .arg(*epoch)
                .arg(1)
                .arg(1);
            let _: i64 = conn.run("breaker probe release", &inv).await?;
            Ok(())
        }
    }
}

/// Settles and/or releases one permit (one script).
pub(crate) async fn settle(conn: &Conn, s: &Settlement) -> Result<(), GovernanceError> {
    let k = &s.keys;
    let mut inv = SETTLE.prepare_invoke();
    inv.key(&k.ledger)
        .key(&k.totals)
        .key(&k.inflight)
        .key(&k.scope_win)
        .arg(&s.id)
        .arg(s.tokens.map(|t| exact(t).to_string()).unwrap_or_default())
        .arg(if s.release { "1" } else { "0" })
        .arg(conn.window_ms())
        .arg(conn.margin_ms())
        .arg(&k.source)
        .arg(exact(s.est));
    let _: i64 = conn.run("settle", &inv).await?;
    Ok(())
}

/// The queue task: applies jobs in order, each retried with backoff until it lands (see
/// the module doc); ends once every sender is gone and the queue is empty.
async fn drain(conn: Conn, mut rx: mpsc::Receiver<Job>, counters: Arc<Counters>) {
    let base = Duration::from_millis(50);
    let mut last_warn: Option<Instant> = None;
    while let Some(job) = rx.recv().await {
        let work = match job {
            Job::Flush(reply) => {
                // The flusher may have given up waiting; nothing to do then.
                let _ = reply.send(());
                continue;
            }
            Job::Work(w) => w,
        };
        let mut tries = 0u32;
        let mut delay = base;
        loop {
            match apply(&conn, &work).await {
                Ok(()) => break,
                Err(e) => {
                    tries += 1;
                    let now = Instant::now();
                    if last_warn.is_none_or(|t| now.duration_since(t) >= LOG_EVERY) {
                        tracing::warn!(error = %e, tries, "queued settlement failed; retrying with backoff");
                        last_warn = Some(now);
                    }
                    *lock(&counters.last_error) = Some(e.message.clone());
                    if rx.is_closed() && tries >= conn.opts.settle_attempts.max(1) {
                        counters.lost.fetch_add(1, Ordering::AcqRel);
                        tracing::warn!(error = %e, "queued settlement given up: the governance is gone; its slot frees when its lease ends");
                        break;
                    }
                    let jitter = fastrand::u64(..=delay.as_millis() as u64 / 2);
                    tokio::time::sleep(delay + Duration::from_millis(jitter)).await;
                    delay = (delay * 2).min(conn.opts.max_backoff.max(base));
                }
            }
        }
        counters.pending.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The heartbeat task (see the module doc).
async fn heartbeat(bg: Arc<Background>) {
    let mut last = Instant::now();
    let mut last_warn: Option<Instant> = None;
    loop {
        let period = {
            let b = lock(&bg.beat);
            if b.stopped {
                break;
            }
            b.leases
                .values()
                .map(|l| l.lease_ms / 3)
                .min()
                .map(|ms| Duration::from_millis(ms.max(1)))
        };
        let Some(period) = period else {
            bg.wake.notified().await;
            last = Instant::now();
            continue;
        };
        let due = last + period;
        if Instant::now() < due {
            tokio::select! {
                _ = tokio::time::sleep_until(due) => {}
                // A lease came or went, or the heartbeat stops: look again.
                _ = bg.wake.notified() => continue,
            }
        }
        if bg.stopped.load(Ordering::Acquire) {
            break;
        }
        last = Instant::now();
        let leases: Vec<(u64, Lease)> = lock(&bg.beat)
            .leases
            .iter()
            .map(|(k, l)| (*k, l.clone()))
            .collect();
        // One script per scope, and one per client key (each in its own slot).
        let mut by_scope: BTreeMap<&str, Vec<&(u64, Lease)>> = BTreeMap::new();
        let mut by_key: BTreeMap<&str, Vec<&(u64, Lease)>> = BTreeMap::new();
        for l in &leases {
            let group = match l.1.kind {
                LeaseKind::Key { .. } => &mut by_key,
                LeaseKind::Permit { .. } | LeaseKind::Probe { .. } => &mut by_scope,
            };
            group.entry(l.1.scope.as_str()).or_default().push(l);
        }
        for (scope, ls) in by_scope {
            let r = renew(bg.conn(), scope, &ls).await;
            renewed(&bg, scope, r, &mut last_warn);
        }
        for (key, ls) in by_key {
            let r = client_keys::renew(bg.conn(), key, &ls).await;
            renewed(&bg, key, r, &mut last_warn);
        }
    }
}

/// What one renewal script did: leases found ended leave the registry (logged).
fn renewed(
    bg: &Background,
    scope: &str,
    r: Result<Vec<u64>, GovernanceError>,
    last_warn: &mut Option<Instant>,
) {
    match r {
        Ok(ended) if ended.is_empty() => {}
        Ok(ended) => {
            let mut b = lock(&bg.beat);
            for k in &ended {
                b.leases.remove(k);
            }
            drop(b);
            tracing::warn!(
                scope,
                ended = ended.len(),
                "leases ended before their heartbeat renewed them (Redis unreachable for a whole lease?): their slots may have been given to other calls"
            );
        }
        Err(e) => {
            let now = Instant::now();
            if last_warn.is_none_or(|t| now.duration_since(t) >= LOG_EVERY) {
                tracing::warn!(scope, error = %e, "lease heartbeat failed; retrying at the next beat");
                *last_warn = Some(now);
            }
        }
    }
}

/// Renews the leases of one scope in one script; returns the registry keys of the leases
/// that had ended.
async fn renew(
    conn: &Conn,
    scope: &str,
    leases: &[&(u64, Lease)],
) -> Result<Vec<u64>, GovernanceError> {
    let [scope_win, ledger, totals] = keys::scope_keys(scope)?;
    let mut groups: BTreeMap<&str, usize> = BTreeMap::new();
    let mut names: Vec<&str> = vec![];
    let mut group_keys: Vec<String> = vec![];
    let mut args: Vec<String> = vec![];
    // A client key's leases are renewed by its own script (`client_keys::renew`).
    let leases: Vec<&(u64, Lease)> = leases
        .iter()
        .copied()
        .filter(|l| !matches!(l.1.kind, LeaseKind::Key { .. }))
        .collect();
    for (_, l) in leases.iter().map(|x| (&x.0, &x.1)) {
        let next = groups.len() + 1;
        let g = *groups.entry(l.source.as_str()).or_insert_with(|| next);
        if g == next {
            let k = SourceKeys::new(scope, &l.source)?;
            names.push(l.source.as_str());
            group_keys.extend([k.inflight, k.win, keys::breaker(scope, &l.source)?]);
        }
        match &l.kind {
            LeaseKind::Permit { id, est } => args.extend([
                "p".into(),
                g.to_string(),
                id.clone(),
                exact(l.lease_ms).to_string(),
                exact(*est).to_string(),
            ]),
            LeaseKind::Probe { epoch } => args.extend([
                "b".into(),
                g.to_string(),
                epoch.to_string(),
                exact(l.lease_ms).to_string(),
                String::new(),
            ]),
            LeaseKind::Key { .. } => unreachable!("filtered out above"),
        }
    }
    let mut inv = RENEW.prepare_invoke();
    inv.key(&ledger).key(&totals).key(&scope_win);
    for k in &group_keys {
        inv.key(k);
    }
    inv.arg(conn.window_ms())
        .arg(conn.margin_ms())
        .arg(names.len());
    for n in &names {
        inv.arg(*n);
    }
    for a in &args {
        inv.arg(a);
    }
    let ended: Vec<usize> = conn.run("lease heartbeat", &inv).await?;
    Ok(ended
        .into_iter()
        .filter_map(|i| leases.get(i.checked_sub(1)?).map(|l| l.0))
        .collect())
}
