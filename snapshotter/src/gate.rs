//! Holding a layer's reads back until its prefetch region is in. A read that needs a byte of
//! the layer not yet here waits for the region (at most `prefetch_timeout`), so a starting
//! container never fetches on demand beside the region. Waiting at the read, not in the
//! container's Prepare, lets containerd and runc set the container up while the region's last
//! bytes arrive: what is here already (the region's first files, `/etc/passwd`) is read at once.

use crate::fill::Progress;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};
use strata_tiering::metrics::FetchHistogram;

/// Where a layer's reads wait for its prefetch region.
#[derive(Debug)]
pub struct RegionGate {
    progress: Arc<Progress>,
    limit: Duration,
    /// Set once the region is over, or once a read waited `limit` for it: from then on no read
    /// waits.
    open: AtomicBool,
    waited: FetchHistogram,
}

impl RegionGate {
    pub fn new(progress: Arc<Progress>, limit: Duration, waited: FetchHistogram) -> RegionGate {
        RegionGate { progress, limit, open: AtomicBool::new(false), waited }
    }

    /// Waits until the region is over (fetched or failed), or `limit`, unless it already is.
    /// Returns whether it waited, in which case what the read wanted may now be cached.
    pub async fn pass(&self, layer: &str) -> bool {
        if self.open.load(Ordering::Acquire) {
            return false;
        }
        if !self.progress.prefetch().pending() {
            self.open.store(true, Ordering::Release);
            return false;
        }
        let started = Instant::now();
        let over = self.progress.prefetched(self.limit).await;
        let waited = started.elapsed();
        self.waited.0.observe(waited.as_secs_f64());
        let first = !self.open.swap(true, Ordering::AcqRel);
        if !over && first {
            tracing::warn!(layer, limit = ?self.limit, "prefetch not done in time; reads fetch on demand from now on");
        }
        tracing::debug!(layer, ?waited, "a read waited for the layer's prefetch region");
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fill::Stage;

    #[tokio::test]
    async fn reads_wait_for_the_region_then_never_again() {
        let progress = Arc::new(Progress::new(1));
        progress.set_prefetch(Stage::Running);
        let gate = Arc::new(RegionGate::new(progress.clone(), Duration::from_secs(30), FetchHistogram::default()));
        let waiting = tokio::spawn({
            let gate = gate.clone();
            async move { gate.pass("l").await }
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!waiting.is_finished(), "a read passed while the region was in flight");
        progress.set_prefetch(Stage::Done);
        assert!(waiting.await.unwrap(), "the read says it waited");
        assert!(!gate.pass("l").await, "a read after the region waits no more");
    }

    #[tokio::test]
    async fn a_region_late_past_the_limit_stops_holding_reads() {
        let progress = Arc::new(Progress::new(1));
        progress.set_prefetch(Stage::Running);
        let gate = RegionGate::new(progress.clone(), Duration::from_millis(20), FetchHistogram::default());
        assert!(gate.pass("l").await);
        // Still running, but the limit was spent once: the next read goes on at once.
        assert!(!gate.pass("l").await);
    }

    #[tokio::test]
    async fn no_region_holds_nothing() {
        let progress = Arc::new(Progress::new(1));
        progress.set_prefetch(Stage::None);
        let gate = RegionGate::new(progress, Duration::from_secs(30), FetchHistogram::default());
        assert!(!gate.pass("l").await);
    }
}
