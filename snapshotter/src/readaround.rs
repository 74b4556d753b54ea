//! Read-around across files, in blob order. A container that reads many small files in the
//! order the layer stores them (`find | xargs cat`, a package manager's scan, an interpreter
//! importing a whole package) would otherwise pay one registry round trip per file. When demand
//! reads walk the blob forwards, each read also brings the chunks after it, in a window that
//! doubles while the walk goes on and closes as soon as a read jumps elsewhere, so scattered
//! start-up reads fetch no more than they need. Once a walk has gone on for a while, the next
//! window is read ahead while the container consumes this one, so the link and the
//! decompression work side by side.

use crate::estargz::Chunk;
use std::ops::Range;
use tokio::sync::watch;

/// A read this close after the last one's end still counts as a walk: the tar headers of
/// directories and links sit between two files' payloads.
const GAP: u64 = 64 << 10;
const FIRST_WINDOW: u64 = 256 << 10;
pub const MAX_WINDOW: u64 = 4 << 20;
/// Windows read ahead at once: one downloading while the one before is decoded and cached.
const AHEAD: usize = 2;

/// Where the demand reads of one layer have got to.
#[derive(Debug, Default)]
pub struct Walk {
    last_end: u64,
    window: u64,
    /// Every range being fetched, whether it is a read ahead (at most [`AHEAD`] are), and
    /// whether it is done: a read of a chunk inside one waits for it instead of fetching again.
    in_flight: Vec<(Range<u64>, bool, watch::Receiver<bool>)>,
}

impl Walk {
    /// Records a demand read of compressed bytes `offset..end`, and returns how many compressed
    /// bytes after `end` to read with it.
    pub fn read(&mut self, offset: u64, end: u64) -> u64 {
        let forwards = self.last_end > 0 && offset >= self.last_end && offset - self.last_end <= GAP;
        self.window = if forwards { (self.window * 2).clamp(FIRST_WINDOW, MAX_WINDOW) } else { 0 };
        self.last_end = end;
        self.window
    }

    /// The read went on to `end`.
    pub fn reached(&mut self, end: u64) {
        self.last_end = self.last_end.max(end);
    }

    /// How far reads and reads ahead have got.
    pub fn frontier(&self) -> u64 {
        self.last_end
    }

    /// The fetch in flight over `offset`, if any: its range, whether it is a read ahead, and
    /// its done signal.
    pub fn in_flight_over(&self, offset: u64) -> Option<(Range<u64>, bool, watch::Receiver<bool>)> {
        self.in_flight.iter().find(|(r, _, _)| r.contains(&offset)).cloned()
    }

    /// Whether a fetch in flight overlaps `range`.
    pub fn overlaps(&self, range: &Range<u64>) -> bool {
        self.in_flight.iter().any(|(r, _, _)| r.start < range.end && range.start < r.end)
    }

    /// Records a fetch of `range`; the sender says when it is done. A read ahead is refused
    /// when [`AHEAD`] are in flight.
    pub fn begin(&mut self, range: Range<u64>, ahead: bool) -> Option<watch::Sender<bool>> {
        if ahead && self.in_flight.iter().filter(|(_, a, _)| *a).count() >= AHEAD {
            return None;
        }
        let (tx, rx) = watch::channel(false);
        if ahead {
            self.reached(range.end);
        }
        self.in_flight.push((range, ahead, rx));
        Some(tx)
    }

    pub fn end(&mut self, range: &Range<u64>) {
        if let Some(i) = self.in_flight.iter().position(|(r, _, _)| r == range) {
            self.in_flight.swap_remove(i);
        }
    }
}

/// The pieces (in blob order) that start at or after `from` and end by `limit`, up to the first
/// one `stop` holds for (one already cached, say).
pub fn following(
    pieces: &[(String, Chunk)],
    from: u64,
    limit: u64,
    stop: impl Fn(&(String, Chunk)) -> bool,
) -> &[(String, Chunk)] {
    let start = pieces.partition_point(|(_, c)| c.offset < from);
    let mut end = start;
    while end < pieces.len() && pieces[end].1.compressed_end <= limit && !stop(&pieces[end]) {
        end += 1;
    }
    &pieces[start..end]
}

/// The pieces wholly between compressed offsets `from` and `to`, in blob order.
pub fn between(pieces: &[(String, Chunk)], from: u64, to: u64) -> &[(String, Chunk)] {
    let start = pieces.partition_point(|(_, c)| c.offset < from);
    let end = start + pieces[start..].partition_point(|(_, c)| c.compressed_end <= to);
    &pieces[start..end]
}

/// Whether a read at `offset` past a gap still continues the walk that got to `from`: the
/// reader only skipped chunks that were already there (a prefetched region, files an earlier
/// container read), which it had no need to fetch.
pub fn skipped_only(
    pieces: &[(String, Chunk)],
    from: u64,
    offset: u64,
    there: impl Fn(&(String, Chunk)) -> bool,
) -> bool {
    from > 0 && offset > from && {
        let skipped = between(pieces, from, offset);
        !skipped.is_empty() && skipped.iter().all(there)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn piece(offset: u64, end: u64) -> (String, Chunk) {
        (
            format!("f{offset}"),
            Chunk { file_offset: 0, size: 1, offset, compressed_end: end, inner_offset: 0, digest: String::new() },
        )
    }

    #[test]
    fn the_window_grows_while_reads_walk_forwards_and_closes_on_a_jump() {
        let mut w = Walk::default();
        assert_eq!(w.read(0, 1000), 0, "a first read is not a walk yet");
        assert_eq!(w.read(1000, 2000), FIRST_WINDOW);
        w.reached(2000 + FIRST_WINDOW);
        assert_eq!(w.read(2000 + FIRST_WINDOW + 512, 300_000), 2 * FIRST_WINDOW, "headers between are fine");
        assert_eq!(w.read(50_000_000, 50_001_000), 0, "a jump closes it");
        assert_eq!(w.read(10, 20), 0, "so does going backwards");
        let mut at = 20;
        for _ in 0..10 {
            w.read(at, at + 10);
            at += 10;
        }
        assert_eq!(w.read(at, at + 10), MAX_WINDOW, "and it stops growing");
    }

    #[test]
    fn following_stops_at_the_limit_and_at_a_cached_piece() {
        let pieces: Vec<_> = (0..10).map(|i| piece(i * 100, (i + 1) * 100)).collect();
        let got = following(&pieces, 200, 650, |_| false);
        assert_eq!(got.iter().map(|p| p.1.offset).collect::<Vec<_>>(), [200, 300, 400, 500]);
        let got = following(&pieces, 200, 10_000, |p| p.1.offset == 400);
        assert_eq!(got.len(), 2);
        assert!(following(&pieces, 1000, 10_000, |_| false).is_empty());
    }

    #[test]
    fn skipping_only_chunks_already_there_continues_a_walk() {
        let pieces: Vec<_> = (0..10).map(|i| piece(i * 100_000, (i + 1) * 100_000)).collect();
        assert_eq!(between(&pieces, 200_000, 500_000).len(), 3);
        let cached = |p: &(String, Chunk)| (200_000..500_000).contains(&p.1.offset);
        assert!(skipped_only(&pieces, 200_000, 500_000, cached));
        assert!(!skipped_only(&pieces, 200_000, 600_000, cached), "the piece at 500000 was not there");
        assert!(!skipped_only(&pieces, 0, 500_000, |_| true), "no walk yet");
        assert!(!skipped_only(&pieces, 500_000, 200_000, |_| true), "backwards");
    }

    #[test]
    fn fetches_in_flight_are_found_by_offset_and_reads_ahead_are_limited() {
        let mut w = Walk::default();
        let demand = w.begin(0..100, false).unwrap();
        assert!(w.begin(100..200, true).is_some() && w.begin(200..300, true).is_some());
        assert!(w.begin(300..400, true).is_none(), "at most {AHEAD} reads ahead");
        assert_eq!(w.frontier(), 300, "reads ahead move the frontier");
        let (range, ahead, _) = w.in_flight_over(150).unwrap();
        assert_eq!((range, ahead), (100..200, true));
        assert!(w.overlaps(&(50..60)) && !w.overlaps(&(300..310)));
        w.end(&(0..100));
        drop(demand);
        assert!(w.in_flight_over(50).is_none());
        w.end(&(100..200));
        assert!(w.begin(300..400, true).is_some(), "a slot came free");
    }
}
