//! When containers last needed the registry: chunk reads they wait on, and snapshot calls that
//! start one. Background fill begins only once the node has been quiet for a while, so a
//! starting container has the whole link to itself; on a 200 Mbit/s link an 8 MiB background
//! range ahead of a start-up read costs that start a third of a second.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;
// Tokio's clock, so tests can pause it.
use tokio::time::Instant;

#[derive(Debug)]
pub struct Activity {
    epoch: Instant,
    /// Milliseconds after `epoch` of the last touch.
    last: AtomicU64,
    /// Reads in flight.
    busy: AtomicUsize,
}

impl Default for Activity {
    fn default() -> Self {
        Activity { epoch: Instant::now(), last: AtomicU64::new(0), busy: AtomicUsize::new(0) }
    }
}

impl Activity {
    /// Something a container waits on happened now.
    pub fn touch(&self) {
        self.last.store(self.epoch.elapsed().as_millis() as u64, Ordering::Relaxed);
    }

    /// A read a container waits on; it stays busy until the guard drops.
    pub fn read(&self) -> Busy<'_> {
        self.touch();
        self.busy.fetch_add(1, Ordering::Relaxed);
        Busy(self)
    }

    /// How long nothing has happened (zero while a read is in flight).
    pub fn idle(&self) -> Duration {
        if self.busy.load(Ordering::Relaxed) > 0 {
            return Duration::ZERO;
        }
        let now = self.epoch.elapsed().as_millis() as u64;
        Duration::from_millis(now.saturating_sub(self.last.load(Ordering::Relaxed)))
    }

    /// Returns once the node has been idle for `period`.
    pub async fn quiet(&self, period: Duration) {
        loop {
            let idle = self.idle();
            if idle >= period {
                return;
            }
            tokio::time::sleep((period - idle).min(Duration::from_millis(50))).await;
        }
    }
}

#[derive(Debug)]
pub struct Busy<'a>(&'a Activity);

impl Drop for Busy<'_> {
    fn drop(&mut self) {
        self.0.busy.fetch_sub(1, Ordering::Relaxed);
        self.0.touch();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn quiet_waits_for_the_last_read_to_end_and_the_period_to_pass() {
        let a = Activity::default();
        a.touch();
        let read = a.read();
        assert_eq!(a.idle(), Duration::ZERO);
        tokio::time::advance(Duration::from_secs(5)).await;
        assert_eq!(a.idle(), Duration::ZERO, "a read in flight keeps the node busy");
        drop(read);
        let before = tokio::time::Instant::now();
        // Paused time: `quiet` sleeps, and the clock moves only as far as those sleeps go.
        a.quiet(Duration::from_millis(300)).await;
        assert!(tokio::time::Instant::now() - before >= Duration::from_millis(300));
    }
}
