//! [`FutureSet`]: the few futures a round polls together (its legs, the attempts being
//! finished).
//!
//! `futures::stream::FuturesUnordered` would do, but it wakes its own task again
//! whenever one poll has polled every future it holds (futures-rs #2333: a yield, so as
//! not to starve the executor). With one leg in flight that is every wake of the leg,
//! and on tokio's multi-thread runtime each such self-wake is a yield that wakes
//! another worker thread: a futex wake and a context switch per call, measured as 2
//! extra futex calls per plain call (docs/BENCHMARKS.md, "Call overhead"). A round
//! holds a handful of futures, so polling each of them on a wake costs less.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use futures_util::Stream;

/// Futures polled in insertion order on every poll; a finished one is yielded and
/// removed. Never wakes its own task.
#[derive(Debug)]
pub(crate) struct FutureSet<F> {
    futures: Vec<F>,
}

impl<F> Default for FutureSet<F> {
    fn default() -> Self {
        FutureSet {
            futures: Vec::new(),
        }
    }
}

impl<F: Future + Unpin> FutureSet<F> {
    pub(crate) fn push(&mut self, f: F) {
        self.futures.push(f);
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.futures.is_empty()
    }

    pub(crate) fn len(&self) -> usize {
        self.futures.len()
    }
}

impl<F: Future + Unpin> Stream for FutureSet<F> {
    type Item = F::Output;

    /// The output of the first future (in insertion order) that is ready; `None` when
    /// the set is empty.
    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<F::Output>> {
        let this = self.get_mut();
        if this.futures.is_empty() {
            return Poll::Ready(None);
        }
        for i in 0..this.futures.len() {
            if let Poll::Ready(out) = Pin::new(&mut this.futures[i]).poll(cx) {
                this.futures.remove(i);
                return Poll::Ready(Some(out));
            }
        }
        Poll::Pending
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures_util::future::{BoxFuture, FutureExt};
    use futures_util::StreamExt;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::task::Wake;

    struct CountingWaker(AtomicUsize);

    impl Wake for CountingWaker {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    #[tokio::test]
    async fn yields_every_output_once_and_never_wakes_itself() {
        let (tx1, rx1) = tokio::sync::oneshot::channel::<u32>();
        let (tx2, rx2) = tokio::sync::oneshot::channel::<u32>();
        let mut set: FutureSet<BoxFuture<'static, u32>> = FutureSet::default();
        assert!(set.is_empty());
        set.push(async move { rx1.await.unwrap() }.boxed());
        set.push(async move { rx2.await.unwrap() }.boxed());
        set.push(async { 3 }.boxed());
        let counter = Arc::new(CountingWaker(AtomicUsize::new(0)));
        let waker = std::task::Waker::from(counter.clone());
        let mut cx = Context::from_waker(&waker);
        assert_eq!(set.poll_next_unpin(&mut cx), Poll::Ready(Some(3)));
        assert_eq!(set.poll_next_unpin(&mut cx), Poll::Pending);
        // Pending with every future polled: no self-wake (FuturesUnordered wakes here).
        assert_eq!(counter.0.load(Ordering::SeqCst), 0);
        tx2.send(2).unwrap();
        assert_eq!(counter.0.load(Ordering::SeqCst), 1, "the channel's wake");
        assert_eq!(set.poll_next_unpin(&mut cx), Poll::Ready(Some(2)));
        tx1.send(1).unwrap();
        assert_eq!(set.next().await, Some(1));
        assert!(set.is_empty());
        assert_eq!(set.next().await, None);
        assert_eq!(counter.0.load(Ordering::SeqCst), 2);
    }
}
