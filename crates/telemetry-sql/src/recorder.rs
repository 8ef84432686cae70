//! [`SqlRecorder`]: a bounded drop-oldest queue that `record()` fills without blocking,
//! and one background task per recorder that writes it in batches, retrying with
//! backoff while the database fails.
//!
//! Accounting: every row given to `record()` is, at any moment, exactly one of written,
//! dropped or pending (`recorded = written + dropped + pending`), and [`FlushReport`]
//! shows the three totals.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use async_trait::async_trait;
use polygw_core::ports::telemetry::{FlushReport, TelemetryRecorder};
use polygw_core::secret::redact_url;
use polygw_core::{TelemetryError, TelemetryRow};
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::config::RecorderConfig;
use crate::db::{describe, Backend, Db, OpenOptions};
use crate::store::{SqlResponseStore, StoreBase};

/// State shared by the recorder handles and the writer task.
#[derive(Debug)]
struct Shared {
    queue: Mutex<VecDeque<TelemetryRow>>,
    capacity: usize,
    batch_size: usize,
    /// Rows given to `record()`.
    recorded: AtomicU64,
    /// Rows in committed batches.
    written: AtomicU64,
    /// Rows dropped: queue overflow (oldest first), or recorded after the writer stopped.
    dropped: AtomicU64,
    /// Rows taken out of the queue by a batch being written.
    in_flight: AtomicU64,
    /// Shutdown asked (or the last handle dropped): the writer drains and stops.
    closing: AtomicBool,
    /// The writer has stopped; `record()` now counts rows as dropped.
    stopped: AtomicBool,
    /// The writer stopped without being asked (a panic).
    crashed: AtomicBool,
    /// A full batch is queued.
    wake: Notify,
    /// `flush()`, `shutdown()` or drop: write now, skip the current backoff.
    urgent: Notify,
    /// Closing was asked (one permit, for the writer's hard stop).
    closed: Notify,
    /// A batch was committed or rows were dropped, or the writer stopped.
    progress: Notify,
    /// The last write failed: why (URL redacted), until a write succeeds again.
    failing: Mutex<Option<String>>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, VecDeque<TelemetryRow>> {
        // A panic while holding the lock cannot leave the deque inconsistent.
        self.queue.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A consistent snapshot: every counter changes under the queue's lock.
    fn report(&self) -> FlushReport {
        let q = self.lock();
        FlushReport {
            written: self.written.load(Ordering::SeqCst),
            dropped: self.dropped.load(Ordering::SeqCst),
            pending: q.len() as u64 + self.in_flight.load(Ordering::SeqCst),
        }
    }

    fn settled(&self) -> u64 {
        self.written.load(Ordering::SeqCst) + self.dropped.load(Ordering::SeqCst)
    }

    /// Takes up to `batch_size` rows from the front.
    fn take_batch(&self) -> Vec<TelemetryRow> {
        let mut q = self.lock();
        let n = q.len().min(self.batch_size);
        let batch: Vec<TelemetryRow> = q.drain(..n).collect();
        self.in_flight.store(batch.len() as u64, Ordering::SeqCst);
        batch
    }

    fn committed(&self, n: usize) {
        {
            let _q = self.lock();
            self.written.fetch_add(n as u64, Ordering::SeqCst);
            self.in_flight.store(0, Ordering::SeqCst);
        }
        self.progress.notify_waiters();
    }

    /// Puts a failed batch back at the front, in order, then drops the oldest rows
    /// beyond capacity.
    fn put_back(&self, batch: Vec<TelemetryRow>) {
        let mut overflow = Vec::new();
        {
            let mut q = self.lock();
            for row in batch.into_iter().rev() {
                q.push_front(row);
            }
            self.in_flight.store(0, Ordering::SeqCst);
            while q.len() > self.capacity {
                if let Some(old) = q.pop_front() {
                    overflow.push(old);
                }
            }
            self.dropped
                .fetch_add(overflow.len() as u64, Ordering::SeqCst);
        }
        if !overflow.is_empty() {
            self.progress.notify_waiters();
        }
    }

    /// Asks the writer to write what is queued and stop (idempotent).
    fn close(&self) {
        if !self.closing.swap(true, Ordering::SeqCst) {
            self.closed.notify_one();
        }
        self.urgent.notify_one();
        self.wake.notify_one();
    }

    fn is_empty(&self) -> bool {
        self.lock().is_empty()
    }

    fn has_full_batch(&self) -> bool {
        self.lock().len() >= self.batch_size
    }
}

/// The writer's last act, also on panic or abort: mark it stopped and wake waiters.
struct StopGuard(Arc<Shared>);

impl Drop for StopGuard {
    fn drop(&mut self) {
        if !self.0.closing.load(Ordering::SeqCst) {
            self.0.crashed.store(true, Ordering::SeqCst);
        }
        self.0.stopped.store(true, Ordering::SeqCst);
        self.0.progress.notify_waiters();
    }
}

/// What the writer remembers between batches: backoff and the warning rate limit.
struct WriterState {
    backoff: Duration,
    failing_since: Option<Instant>,
    failures: u64,
    last_warn: Option<Instant>,
    suppressed: u64,
    dropped_seen: u64,
    last_drop_warn: Option<Instant>,
}

impl WriterState {
    fn new(cfg: &RecorderConfig) -> Self {
        WriterState {
            backoff: cfg.retry_min,
            failing_since: None,
            failures: 0,
            last_warn: None,
            suppressed: 0,
            dropped_seen: 0,
            last_drop_warn: None,
        }
    }
}

/// Everything the writer task owns.
struct Writer {
    shared: Arc<Shared>,
    db: Db,
    cfg: RecorderConfig,
    /// The URL, for errors (passwords removed by `describe`).
    url: String,
    /// The URL as it may be printed.
    label: String,
}

/// What a wake of the writer writes.
#[derive(Debug, Clone, Copy)]
enum Drain {
    /// Everything queued: a flush, a retry after a failure, the close.
    All,
    /// The interval's tick: one batch (however small: a row waits at most about one
    /// interval), then full ones.
    Tick,
    /// A full batch was queued: full batches only (a partial rest waits for the tick).
    Full,
}

impl Writer {
    /// Writes what is queued, batch by batch, as `drain` says ([`Drain`]): under load
    /// every transaction is a full batch instead of what arrived while the last one
    /// was written (issue 42: 54 rows a transaction at 10 000 calls/s, about one WAL
    /// write per row). Stops at the first failure (the failed batch is back at the
    /// front of the queue).
    async fn drain(&self, drain: Drain) -> Result<(), String> {
        let mut first = true;
        loop {
            let partial_ok = match drain {
                Drain::All => true,
                Drain::Tick => std::mem::take(&mut first),
                Drain::Full => false,
            };
            if !partial_ok && !self.shared.has_full_batch() {
                return Ok(());
            }
            let batch = self.shared.take_batch();
            if batch.is_empty() {
                return Ok(());
            }
            let limit = self.cfg.write_timeout;
            match tokio::time::timeout(limit, self.db.insert(&batch)).await {
                Ok(Ok(())) => self.shared.committed(batch.len()),
                Ok(Err(e)) => {
                    self.shared.put_back(batch);
                    return Err(describe(&e, &self.url));
                }
                Err(_) => {
                    self.shared.put_back(batch);
                    return Err(format!("write timed out after {limit:?}"));
                }
            }
        }
    }

    fn on_success(&self, st: &mut WriterState) {
        *self
            .shared
            .failing
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = None;
        if let Some(since) = st.failing_since.take() {
            tracing::info!(
                url = %self.label,
                failures = st.failures,
                down_ms = since.elapsed().as_millis() as u64,
                written = self.shared.written.load(Ordering::SeqCst),
                "telemetry database is back; queued rows written"
            );
        }
        st.failures = 0;
        st.suppressed = 0;
        st.backoff = self.cfg.retry_min;
    }

    fn on_failure(&self, st: &mut WriterState, error: &str) {
        *self
            .shared
            .failing
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = Some(error.to_string());
        let now = Instant::now();
        st.failing_since.get_or_insert(now);
        st.failures += 1;
        let due = st
            .last_warn
            .is_none_or(|t| now.duration_since(t) >= self.cfg.warn_interval);
        if due {
            tracing::warn!(
                url = %self.label,
                error = %error,
                pending = self.shared.report().pending,
                failures = st.failures,
                suppressed = st.suppressed,
                retry_in_ms = st.backoff.as_millis() as u64,
                "telemetry write failed; rows stay queued and the write is retried"
            );
            st.last_warn = Some(now);
            st.suppressed = 0;
        } else {
            st.suppressed += 1;
        }
    }

    fn check_drops(&self, st: &mut WriterState) {
        let dropped = self.shared.dropped.load(Ordering::SeqCst);
        if dropped <= st.dropped_seen {
            return;
        }
        let now = Instant::now();
        let due = st
            .last_drop_warn
            .is_none_or(|t| now.duration_since(t) >= self.cfg.warn_interval);
        if due {
            tracing::warn!(
                url = %self.label,
                dropped_total = dropped,
                dropped_new = dropped - st.dropped_seen,
                capacity = self.shared.capacity,
                "telemetry queue full: the oldest rows were dropped"
            );
            st.dropped_seen = dropped;
            st.last_drop_warn = Some(now);
        }
    }

    async fn run(self) {
        let _guard = StopGuard(self.shared.clone());
        let mut st = WriterState::new(&self.cfg);
        // Once closing is asked (shutdown or drop), the task has `flush_timeout` left:
        // past it, a write still running is cancelled (its rows stay counted as pending).
        let hard_stop = async {
            self.shared.closed.notified().await;
            tokio::time::sleep(self.cfg.flush_timeout).await;
        };
        tokio::select! {
            _ = self.work(&mut st) => {}
            _ = hard_stop => {
                tracing::warn!(
                    url = %self.label,
                    pending = self.shared.report().pending,
                    "telemetry shutdown: rows could not be written within flush_timeout and are lost"
                );
            }
        }
        let _ = tokio::time::timeout(Duration::from_secs(1), self.db.close()).await;
    }

    /// The writer's loop, then the last drain once closing is asked.
    async fn work(&self, st: &mut WriterState) {
        let mut idle_wait = true;
        while !self.shared.closing.load(Ordering::SeqCst) {
            // After a failure, or when asked to flush: everything queued.
            let mut drain = if idle_wait { Drain::Full } else { Drain::All };
            if idle_wait && !self.shared.has_full_batch() {
                tokio::select! {
                    _ = self.shared.wake.notified() => {}
                    _ = self.shared.urgent.notified() => drain = Drain::All,
                    _ = tokio::time::sleep(self.cfg.flush_interval) => drain = Drain::Tick,
                }
                if self.shared.closing.load(Ordering::SeqCst) {
                    break;
                }
            }
            match self.drain(drain).await {
                Ok(()) => {
                    self.on_success(st);
                    idle_wait = true;
                }
                Err(e) => {
                    self.on_failure(st, &e);
                    // Backoff; a flush, a shutdown or a drop cuts it short.
                    tokio::select! {
                        _ = tokio::time::sleep(st.backoff) => {}
                        _ = self.shared.urgent.notified() => {}
                    }
                    st.backoff = (st.backoff * 2).min(self.cfg.retry_max);
                    idle_wait = false;
                }
            }
            self.check_drops(st);
        }
        // Closing: write what is queued, retrying with backoff (bounded by `run`).
        while !self.shared.is_empty() {
            match self.drain(Drain::All).await {
                Ok(()) => self.on_success(st),
                Err(e) => {
                    self.on_failure(st, &e);
                    tokio::time::sleep(st.backoff).await;
                    st.backoff = (st.backoff * 2).min(self.cfg.retry_max);
                }
            }
        }
    }
}

/// What the recorder handles share; dropping the last one stops the writer.
#[derive(Debug)]
struct Inner {
    shared: Arc<Shared>,
    task: Mutex<Option<JoinHandle<()>>>,
    cfg: RecorderConfig,
    backend: Backend,
    label: String,
    /// The connections of [`SqlRecorder::response_store`].
    store: Arc<StoreBase>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        // Without an await, the writer is asked to make its last bounded write
        // (`flush_timeout`) and to stop; it ends by itself, cancelling a write that runs
        // past the bound. `shutdown().await` is the way to wait for it.
        self.shared.close();
    }
}

/// The SQL telemetry recorder (SPEC §8): SQLite or PostgreSQL, chosen by the URL.
///
/// - [`TelemetryRecorder::record`] is synchronous, never blocks on I/O and never fails:
///   it pushes onto a bounded queue behind a `std` mutex (held for a push), dropping the
///   oldest row when the queue is full (counted in `dropped`). It works from any thread,
///   inside or outside a tokio runtime, including `Drop` impls.
/// - One background task writes batches of up to `batch_size` rows, one transaction per
///   batch, `INSERT … ON CONFLICT (call_id) DO NOTHING` (idempotent). It wakes when a
///   full batch is queued, every `flush_interval`, and on `flush`; a wake writes one
///   batch and then only full ones (a flush: everything), so under load every
///   transaction is a full batch.
/// - While the database fails, rows stay queued (up to capacity), a warning is logged at
///   most once per `warn_interval` (URL redacted), and the write is retried with
///   exponential backoff from `retry_min` to `retry_max`; when the database is back
///   everything queued is written.
/// - [`TelemetryRecorder::flush`] asks for a write now and waits (at most
///   `flush_timeout`) until every row recorded before the call is written or dropped.
/// - [`SqlRecorder::shutdown`] makes a last bounded write (`flush_timeout`) and stops the
///   task; rows recorded afterwards count as dropped.
/// - Dropping the last handle without `shutdown` asks the task for the same last bounded
///   write and lets it end by itself (it never outlives the drop by more than
///   `flush_timeout`, and dies with the runtime).
///
/// Clones share the queue and the task.
#[derive(Debug, Clone)]
pub struct SqlRecorder {
    inner: Arc<Inner>,
}

impl SqlRecorder {
    /// Opens `sqlite://PATH` (the file is created when missing; WAL journal) or
    /// `postgres://…`/`postgresql://…`, runs the embedded migrations, and spawns the
    /// writer on the current tokio runtime.
    ///
    /// Fails when the URL is not one of those, the database cannot be reached within
    /// `write_timeout`, a migration fails, or the configuration is invalid. Errors and
    /// logs never show the URL's password or query.
    pub async fn connect(url: &str, config: RecorderConfig) -> Result<SqlRecorder, TelemetryError> {
        config.validate()?;
        let db = Db::open(
            url,
            OpenOptions {
                create: true,
                timeout: config.write_timeout,
            },
        )
        .await?;
        if let Err(e) = db.migrate(url).await {
            db.close().await;
            return Err(e);
        }
        let backend = db.backend();
        let label = redact_url(url);
        let store = match db.for_store(url, config.write_timeout) {
            Ok(store_db) => Arc::new(StoreBase::new(store_db, url, &label, config.write_timeout)),
            Err(e) => {
                db.close().await;
                return Err(e);
            }
        };
        let shared = Arc::new(Shared {
            queue: Mutex::new(VecDeque::with_capacity(
                config.queue_capacity.min(config.batch_size * 4),
            )),
            capacity: config.queue_capacity,
            batch_size: config.batch_size,
            recorded: AtomicU64::new(0),
            written: AtomicU64::new(0),
            dropped: AtomicU64::new(0),
            in_flight: AtomicU64::new(0),
            closing: AtomicBool::new(false),
            stopped: AtomicBool::new(false),
            crashed: AtomicBool::new(false),
            wake: Notify::new(),
            urgent: Notify::new(),
            closed: Notify::new(),
            progress: Notify::new(),
            failing: Mutex::new(None),
        });
        let writer = Writer {
            shared: shared.clone(),
            db,
            cfg: config.clone(),
            url: url.to_string(),
            label: label.clone(),
        };
        let task = tokio::spawn(writer.run());
        tracing::debug!(url = %label, backend = backend.as_str(), "telemetry recorder started");
        Ok(SqlRecorder {
            inner: Arc::new(Inner {
                shared,
                task: Mutex::new(Some(task)),
                cfg: config,
                backend,
                label,
                store,
            }),
        })
    }

    /// The [`polygw_core::ports::ResponseStore`] of this database: table
    /// `polygw_responses` (SPEC §18.1), each operation bounded by `write_timeout`.
    /// SQLite: on the recorder's one connection; PostgreSQL: on a pool of its own (up to
    /// [`crate::STORE_PG_CONNECTIONS`], opened on first use) so that reads never wait
    /// behind a batch insert. Every call returns a handle on the same connections. A
    /// store keeps the database open while it lives; [`SqlRecorder::shutdown`] closes it.
    pub fn response_store(&self) -> SqlResponseStore {
        let keep: Option<Arc<dyn std::fmt::Debug + Send + Sync>> = match self.inner.backend {
            // The writer closes the connection it shares when it stops: keep it running.
            Backend::Sqlite => Some(self.inner.clone()),
            Backend::Postgres => None,
        };
        SqlResponseStore::new(self.inner.store.clone(), keep)
    }

    /// The backend the URL named.
    pub fn backend(&self) -> Backend {
        self.inner.backend
    }

    /// The URL with any password and query redacted.
    pub fn url_label(&self) -> &str {
        &self.inner.label
    }

    /// The configuration in use.
    pub fn config(&self) -> &RecorderConfig {
        &self.inner.cfg
    }

    /// Totals now, without waiting (for metrics).
    pub fn snapshot(&self) -> FlushReport {
        self.inner.shared.report()
    }

    /// Rows given to `record()` so far (= written + dropped + pending).
    pub fn recorded(&self) -> u64 {
        self.inner.shared.recorded.load(Ordering::SeqCst)
    }

    /// Whether the writer task has stopped (after `shutdown`, or a drop of every handle).
    pub fn is_stopped(&self) -> bool {
        self.inner.shared.stopped.load(Ordering::SeqCst)
    }

    /// A read-only view of the counters that does not keep the recorder alive (for a
    /// metrics exporter, or to watch the writer end after the last handle is dropped).
    pub fn monitor(&self) -> RecorderMonitor {
        RecorderMonitor {
            shared: self.inner.shared.clone(),
        }
    }

    /// Writes what is queued (at most `flush_timeout`), stops the writer task and
    /// reports the final totals; `pending` rows are lost. Idempotent; rows recorded after
    /// it count as dropped. Every clone sees the recorder stopped.
    pub async fn shutdown(&self) -> FlushReport {
        let s = &self.inner.shared;
        s.close();
        let task = self
            .inner
            .task
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(task) = task {
            let abort = task.abort_handle();
            // The writer bounds its last write by flush_timeout; the margin covers
            // closing the pool. Past it, the task is aborted.
            let bound = self.inner.cfg.flush_timeout + Duration::from_secs(2);
            if tokio::time::timeout(bound, task).await.is_err() {
                abort.abort();
            }
        }
        s.stopped.store(true, Ordering::SeqCst);
        // The response store's connections too (SQLite: the writer's, closed already).
        // Bounded; a close cut short would leave idle connections until the last store
        // handle is dropped.
        let _ =
            tokio::time::timeout(self.inner.cfg.flush_timeout, self.inner.store.db.close()).await;
        s.report()
    }
}

/// Counters of a [`SqlRecorder`], readable after every handle is gone.
#[derive(Debug, Clone)]
pub struct RecorderMonitor {
    shared: Arc<Shared>,
}

impl RecorderMonitor {
    /// Written, dropped and pending totals now.
    pub fn snapshot(&self) -> FlushReport {
        self.shared.report()
    }

    /// Rows given to `record()` so far (= written + dropped + pending).
    pub fn recorded(&self) -> u64 {
        self.shared.recorded.load(Ordering::SeqCst)
    }

    /// Whether the writer task has stopped.
    pub fn is_stopped(&self) -> bool {
        self.shared.stopped.load(Ordering::SeqCst)
    }
}

#[async_trait]
impl TelemetryRecorder for SqlRecorder {
    fn record(&self, row: TelemetryRow) {
        let s = &self.inner.shared;
        if s.stopped.load(Ordering::Relaxed) {
            s.recorded.fetch_add(1, Ordering::SeqCst);
            s.dropped.fetch_add(1, Ordering::SeqCst);
            return;
        }
        let (len, old) = {
            let mut q = s.lock();
            let old = if q.len() >= s.capacity {
                s.dropped.fetch_add(1, Ordering::SeqCst);
                q.pop_front()
            } else {
                None
            };
            q.push_back(row);
            s.recorded.fetch_add(1, Ordering::SeqCst);
            (q.len(), old)
        };
        // Freed outside the lock.
        drop(old);
        if len >= s.batch_size {
            s.wake.notify_one();
        }
    }

    fn dropped(&self) -> u64 {
        self.inner.shared.dropped.load(Ordering::SeqCst)
    }

    async fn flush(&self) -> Result<FlushReport, TelemetryError> {
        let s = &self.inner.shared;
        let target = s.recorded.load(Ordering::SeqCst);
        let deadline = Instant::now() + self.inner.cfg.flush_timeout;
        s.urgent.notify_one();
        loop {
            let progress = s.progress.notified();
            tokio::pin!(progress);
            progress.as_mut().enable();
            if s.settled() >= target || s.stopped.load(Ordering::SeqCst) {
                break;
            }
            if tokio::time::timeout_at(deadline, progress).await.is_err() {
                break;
            }
        }
        let report = s.report();
        if s.crashed.load(Ordering::SeqCst) && report.pending > 0 {
            return Err(TelemetryError(format!(
                "telemetry writer for {} stopped unexpectedly; {} rows pending",
                self.inner.label, report.pending
            )));
        }
        Ok(report)
    }

    /// Not writable when the writer has stopped or its last write failed (the rows
    /// wait in the queue); else one cheap check on the store's connections, bounded by
    /// `write_timeout`: PostgreSQL — a primary (not in recovery) where `llm_calls`
    /// takes `INSERT`; SQLite — the write lock can be taken (`BEGIN IMMEDIATE`, rolled
    /// back). Nothing is written.
    async fn check_writable(&self) -> Result<(), TelemetryError> {
        let s = &self.inner.shared;
        if s.stopped.load(Ordering::SeqCst) {
            return Err(TelemetryError(format!(
                "telemetry writer for {} has stopped",
                self.inner.label
            )));
        }
        let failing = s.failing.lock().unwrap_or_else(|e| e.into_inner()).clone();
        if let Some(e) = failing {
            return Err(TelemetryError(format!(
                "the last telemetry write to {} failed ({} rows pending): {e}",
                self.inner.label,
                s.report().pending
            )));
        }
        self.inner.store.check_writable().await
    }
}
