//! Sequential read-ahead per open file. A run of reads that moves forward (allowing for the
//! kernel's reordering: up to 1 MiB back, 16 MiB forward) grows a window that doubles from two
//! chunks up to a cap; a jump elsewhere resets it. Prefetched chunks land in the cache tiers,
//! not in memory, and the fetches in flight are bounded by the mount's memory budget.

use std::ops::Range;

const BACK: u64 = 1 << 20;
const FORWARD: u64 = 16 << 20;

#[derive(Debug, Default)]
pub struct ReadAhead {
    next: u64,
    window: u64,
    ahead_to: u64,
}

impl ReadAhead {
    /// Records a read of `[offset, end)` and returns the chunk indices to fetch ahead, if any.
    pub fn on_read(
        &mut self,
        offset: u64,
        end: u64,
        chunk: u64,
        file_size: u64,
        max_window: u64,
    ) -> Option<Range<u64>> {
        let sequential = offset + BACK >= self.next && offset <= self.next + FORWARD;
        if !sequential {
            self.window = 0;
            self.ahead_to = 0;
            self.next = end;
            return None;
        }
        self.window = if self.window == 0 { 2 * chunk } else { (self.window * 2).min(max_window) };
        self.next = self.next.max(end);
        let target = (end + self.window).min(file_size);
        let start = self.ahead_to.max(end);
        self.ahead_to = self.ahead_to.max(target);
        if start >= target {
            return None;
        }
        Some(start / chunk..target.div_ceil(chunk))
    }

    /// Whether the last read continued a run forward (a jump elsewhere ends the run).
    pub fn sequential(&self) -> bool {
        self.window > 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const C: u64 = 1 << 20;

    #[test]
    fn window_grows_on_sequential_reads_and_resets_on_a_jump() {
        let mut r = ReadAhead::default();
        assert_eq!(r.on_read(0, C, C, 1 << 30, 64 * C), Some(1..3));
        assert_eq!(r.on_read(C, 2 * C, C, 1 << 30, 64 * C), Some(3..6));
        assert_eq!(r.on_read(2 * C, 3 * C, C, 1 << 30, 64 * C), Some(6..11));
        // The kernel may hand reads over slightly out of order.
        assert!(r.on_read(3 * C + C / 2, 4 * C, C, 1 << 30, 64 * C).is_some());
        assert!(r.on_read(3 * C, 3 * C + C / 2, C, 1 << 30, 64 * C).is_none() || r.window > 0);
        // A jump far away is random access: no read-ahead.
        assert_eq!(r.on_read(900 * C, 901 * C, C, 1 << 30, 64 * C), None);
        assert_eq!(r.window, 0);
    }

    #[test]
    fn window_is_capped_and_stops_at_the_end() {
        let mut r = ReadAhead::default();
        let mut last = None;
        for i in 0..20 {
            last = r.on_read(i * C, (i + 1) * C, C, 1 << 30, 8 * C);
        }
        let range = last.unwrap();
        assert!(range.end - 20 <= 8, "{range:?}");
        let mut r = ReadAhead::default();
        assert_eq!(r.on_read(0, C, C, 2 * C, 64 * C), Some(1..2));
        assert_eq!(r.on_read(C, 2 * C, C, 2 * C, 64 * C), None);
    }
}
