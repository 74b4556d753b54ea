//! The chunks of one open file held in memory between their fetch and the reads that consume
//! them. The kernel reads at most 1 MiB at a time, several at once and slightly out of order, so
//! without this every read of a larger chunk would fetch or read it from a tier again; and a
//! chunk fetched ahead would be written to a tier only to be read straight back. A slot is a
//! shared future, so concurrent reads of one chunk wait on one load.
//!
//! Slots loaded ahead of the reader hold a permit of the mount's memory budget until the reader
//! has moved past them; slots a read asked for hold none, and there are at most a few of those.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::future::{BoxFuture, Shared};
use strata_tiering::CacheError;
use tokio::sync::OwnedSemaphorePermit;

/// One chunk being loaded, or loaded.
pub type ChunkFuture = Shared<BoxFuture<'static, Result<Bytes, Arc<CacheError>>>>;

#[derive(Debug)]
struct Slot {
    chunk: ChunkFuture,
    /// Loaded ahead of the reader, under this share of the memory budget.
    ahead: Option<OwnedSemaphorePermit>,
}

#[derive(Debug)]
pub struct Window {
    slots: BTreeMap<u64, Slot>,
    used: Instant,
}

impl Default for Window {
    fn default() -> Self {
        Window { slots: BTreeMap::new(), used: Instant::now() }
    }
}

impl Window {
    /// Makes room for a read of chunks `first..=last`: drops what the reader has moved past
    /// (keeping one chunk behind, for the kernel's reordering), the chunks an earlier read asked
    /// for elsewhere, and anything loaded ahead beyond `ahead` chunks past `last`.
    pub fn advance(&mut self, first: u64, last: u64, ahead: u64) {
        self.used = Instant::now();
        let behind = first.saturating_sub(1);
        self.slots.retain(|&i, s| i >= behind && (i <= last || (s.ahead.is_some() && i <= last.saturating_add(ahead))));
    }

    pub fn contains(&self, i: u64) -> bool {
        self.slots.contains_key(&i)
    }

    /// The slot of chunk `i`, started by `start` if there is none, or if its load failed: a
    /// read after an error (the store was away) tries again rather than get the old error.
    pub fn demand(&mut self, i: u64, start: impl FnOnce() -> ChunkFuture) -> ChunkFuture {
        if self.slots.get(&i).is_some_and(|s| s.chunk.peek().is_some_and(|r| r.is_err())) {
            self.slots.remove(&i);
        }
        self.slots.entry(i).or_insert_with(|| Slot { chunk: start(), ahead: None }).chunk.clone()
    }

    /// Records chunk `i`, loading ahead of the reader under `permit`.
    pub fn ahead(&mut self, i: u64, chunk: ChunkFuture, permit: OwnedSemaphorePermit) {
        self.slots.entry(i).or_insert(Slot { chunk, ahead: Some(permit) });
    }

    /// Gives back the memory budget of chunks loaded ahead for a reader that has not read for
    /// `idle`, so an open file nobody reads cannot starve the others' read-ahead. Returns
    /// whether anything was given back.
    pub fn release_if_idle(&mut self, idle: Duration) -> bool {
        if self.used.elapsed() < idle {
            return false;
        }
        let before = self.slots.len();
        self.slots.retain(|_, s| s.ahead.is_none());
        self.slots.len() != before
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::FutureExt;

    fn ready(n: u8) -> ChunkFuture {
        futures::future::ready(Ok(Bytes::from(vec![n]))).boxed().shared()
    }

    fn permit(s: &Arc<tokio::sync::Semaphore>) -> OwnedSemaphorePermit {
        s.clone().try_acquire_owned().unwrap()
    }

    #[tokio::test]
    async fn one_load_per_chunk_and_the_budget_comes_back_as_the_reader_moves_on() {
        let budget = Arc::new(tokio::sync::Semaphore::new(4));
        let mut w = Window::default();
        for i in 1..4 {
            w.ahead(i, ready(i as u8), permit(&budget));
        }
        assert_eq!(budget.available_permits(), 1);
        let mut started = 0;
        let a = w.demand(0, || {
            started += 1;
            ready(0)
        });
        let b = w.demand(0, || {
            started += 1;
            ready(9)
        });
        assert_eq!(started, 1);
        assert_eq!(a.await.unwrap(), b.await.unwrap());
        // A chunk loaded ahead is what a later read gets.
        assert_eq!(w.demand(2, || ready(9)).await.unwrap()[0], 2);
        w.advance(3, 3, 4);
        assert!(!w.contains(0) && !w.contains(1) && w.contains(2) && w.contains(3));
        assert_eq!(budget.available_permits(), 2);
        // A jump back far: everything ahead is beyond the reach of the new position.
        w.advance(100, 100, 4);
        assert!(!w.contains(3));
        assert_eq!(budget.available_permits(), 4);
    }

    #[tokio::test]
    async fn a_failed_load_is_tried_again_by_the_next_read() {
        let budget = Arc::new(tokio::sync::Semaphore::new(1));
        let mut w = Window::default();
        let failed: ChunkFuture =
            futures::future::ready(Err(Arc::new(CacheError::Task("store away".into())))).boxed().shared();
        w.ahead(0, failed, permit(&budget));
        assert!(w.demand(0, || ready(9)).await.is_err(), "the failure is this read's");
        assert_eq!(w.demand(0, || ready(7)).await.unwrap()[0], 7, "the next read loads it again");
        assert_eq!(budget.available_permits(), 1, "the failed slot's budget came back");
    }

    #[tokio::test]
    async fn an_idle_reader_gives_back_its_read_ahead() {
        let budget = Arc::new(tokio::sync::Semaphore::new(2));
        let mut w = Window::default();
        assert_eq!(w.demand(0, || ready(0)).await.unwrap()[0], 0);
        w.ahead(1, ready(1), permit(&budget));
        assert!(!w.release_if_idle(Duration::from_secs(60)));
        assert!(w.release_if_idle(Duration::ZERO));
        assert_eq!(budget.available_permits(), 2);
        assert!(w.contains(0) && !w.contains(1));
    }
}
