//! A chunk's bytes as they arrive from its fetcher, for readers that pass them on before the
//! whole chunk is in: a member serving a peer sends each piece as its origin yields it, rather
//! than holding the chunk whole first (store and forward costs a chunk's transfer time per hop).
//!
//! What a tail yields is not checked: the fetcher's final answer is. A reader that passes
//! pieces on must compare what it passed with that answer (by CRC32C, say) before it vouches
//! for them.

use bytes::Bytes;
use std::sync::{Arc, Mutex};
use tokio::sync::watch;

/// Where a fetcher tells of the bytes it has so far. Cheap to clone.
#[derive(Clone, Debug)]
pub struct Progress {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    pieces: Mutex<Vec<Bytes>>,
    /// Bytes arrived, and whether the fetch has ended: tails wait on it.
    state: watch::Sender<(u64, bool)>,
}

impl Default for Progress {
    fn default() -> Self {
        Progress { inner: Arc::new(Inner { pieces: Mutex::default(), state: watch::Sender::new((0, false)) }) }
    }
}

impl Progress {
    /// `piece` arrived at byte `offset` of the chunk. Only what lies past the bytes told of
    /// before is kept: a fetch that resumed, or began again, repeats what came before.
    pub fn arrived(&self, offset: u64, piece: &Bytes) {
        let mut pieces = self.inner.pieces.lock().unwrap_or_else(|p| p.into_inner());
        let (have, done) = *self.inner.state.borrow();
        let end = offset + piece.len() as u64;
        if done || offset > have || end <= have {
            return;
        }
        pieces.push(piece.slice((have - offset) as usize..));
        self.inner.state.send_replace((end, false));
    }

    /// The fetch has ended, with an answer or not: tails stop once they have what arrived.
    pub fn finish(&self) {
        let _pieces = self.inner.pieces.lock().unwrap_or_else(|p| p.into_inner());
        self.inner.state.send_modify(|s| s.1 = true);
    }

    /// A guard that finishes the progress when dropped: tails end even if the fetch panics.
    pub fn finish_on_drop(&self) -> FinishOnDrop {
        FinishOnDrop(self.clone())
    }

    /// A reader of every piece from the first, however late it starts.
    pub fn tail(&self) -> Tail {
        Tail { progress: self.clone(), next: 0, state: self.inner.state.subscribe() }
    }

    /// Bytes told of so far.
    pub fn len(&self) -> u64 {
        self.inner.state.borrow().0
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Tells a [`Progress`] of a buffer that grows, in batches: a network read gives pieces of a
/// few KiB, and a wake of every tail and a frame to every asker per such piece costs more CPU
/// than a copy of them does. The reader tells what it has before it waits for more
/// ([`Teller::tell`]), so a batch never waits on the network, and at [`Teller::BATCH`] at the
/// latest ([`Teller::grew`]).
#[derive(Debug)]
pub struct Teller<'a> {
    progress: Option<&'a Progress>,
    told: usize,
}

impl<'a> Teller<'a> {
    pub const BATCH: usize = 64 << 10;

    /// A teller of a buffer whose first `told` bytes `progress` knows already.
    pub fn new(progress: Option<&'a Progress>, told: usize) -> Self {
        Teller { progress, told }
    }

    /// `whole` has grown: tells what is new of it, once there is a batch.
    pub fn grew(&mut self, whole: &[u8]) {
        if whole.len() >= self.told + Self::BATCH {
            self.tell(whole);
        }
    }

    /// Tells whatever is new of `whole`. With no tail to read it, nothing is copied: a tail
    /// that starts later gets every byte from the first at the next tell, or from the answer.
    pub fn tell(&mut self, whole: &[u8]) {
        let Some(p) = self.progress else { return };
        if whole.len() > self.told && p.inner.state.receiver_count() > 0 {
            p.arrived(self.told as u64, &Bytes::copy_from_slice(&whole[self.told..]));
            self.told = whole.len();
        }
    }
}

/// Finishes its [`Progress`] when dropped.
#[derive(Debug)]
pub struct FinishOnDrop(Progress);

impl Drop for FinishOnDrop {
    fn drop(&mut self) {
        self.0.finish();
    }
}

/// The pieces of one [`Progress`], in order.
#[derive(Debug)]
pub struct Tail {
    progress: Progress,
    next: usize,
    state: watch::Receiver<(u64, bool)>,
}

impl Tail {
    /// The next piece, once it has arrived; `None` once the fetch has ended and every piece
    /// that arrived has been taken.
    pub async fn next(&mut self) -> Option<Bytes> {
        loop {
            // The state is read before the pieces: a piece added after this read changes the
            // state again, so the wait below cannot miss it.
            let done = self.state.borrow_and_update().1;
            {
                let pieces = self.progress.inner.pieces.lock().unwrap_or_else(|p| p.into_inner());
                if let Some(p) = pieces.get(self.next) {
                    self.next += 1;
                    return Some(p.clone());
                }
            }
            if done || self.state.changed().await.is_err() {
                return None;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn all(mut t: Tail) -> Vec<u8> {
        let mut out = Vec::new();
        while let Some(p) = t.next().await {
            out.extend_from_slice(&p);
        }
        out
    }

    #[tokio::test]
    async fn a_tail_gets_every_byte_once_whenever_it_starts() {
        let p = Progress::default();
        let early = tokio::spawn(all(p.tail()));
        p.arrived(0, &Bytes::from_static(b"abc"));
        let middle = tokio::spawn(all(p.tail()));
        tokio::task::yield_now().await;
        p.arrived(3, &Bytes::from_static(b"def"));
        // A resumed fetch repeats a byte; a fetch begun again repeats them all.
        p.arrived(5, &Bytes::from_static(b"fgh"));
        p.arrived(0, &Bytes::from_static(b"abcdefgh"));
        // A piece past a gap would put bytes at the wrong offset: it is not taken.
        p.arrived(20, &Bytes::from_static(b"zz"));
        p.finish();
        p.arrived(8, &Bytes::from_static(b"late"));
        let late = all(p.tail()).await;
        for got in [early.await.unwrap(), middle.await.unwrap(), late] {
            assert_eq!(got, b"abcdefgh");
        }
        assert_eq!(p.len(), 8);
    }

    #[tokio::test]
    async fn a_teller_tells_in_batches_and_all_at_the_end() {
        let p = Progress::default();
        let mut teller = Teller::new(Some(&p), 0);
        let data: Vec<u8> = (0..3 * Teller::BATCH).map(|i| i as u8).collect();
        teller.grew(&data[..Teller::BATCH + 1]);
        assert_eq!(p.len(), 0, "no tail, no copy");
        let tail = p.tail();
        teller.grew(&data[..Teller::BATCH - 1]);
        teller.grew(&data[..Teller::BATCH + 2]);
        assert_eq!(p.len() as usize, Teller::BATCH + 2, "a tail gets the bytes from the first");
        teller.grew(&data[..2 * Teller::BATCH]);
        assert_eq!(p.len() as usize, Teller::BATCH + 2, "less than a batch waits");
        teller.tell(&data);
        p.finish();
        assert_eq!(all(tail).await, data);
    }

    #[tokio::test]
    async fn a_tail_waits_for_the_next_piece_and_ends_with_the_fetch() {
        let p = Progress::default();
        let mut t = p.tail();
        let waiting = tokio::spawn(async move { (t.next().await, t.next().await) });
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        assert!(!waiting.is_finished(), "no piece yet, and the fetch goes on");
        p.arrived(0, &Bytes::from_static(b"x"));
        p.finish();
        assert_eq!(waiting.await.unwrap(), (Some(Bytes::from_static(b"x")), None));
    }
}
