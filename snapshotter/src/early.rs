//! Requests for a layer's bytes made before its TOC is parsed, so the link carries them while
//! the TOC is still on its way or being read: its prefetch region, which starts at the blob's
//! first byte and ends where the descriptor's hint or the landmark's own TOC entry says, or a
//! chunk of the image's program, where the TOC's entries for it say. Whatever a request brings
//! is checked chunk by chunk against the parsed TOC before it is cached, and a request the
//! parse does not confirm is stopped.

use crate::registry::range_stream::RangeStream;
use crate::registry::{ImageRef, Registry, RegistryError};
use std::ops::Range;
use std::sync::Arc;

/// A request for a layer's bytes `range`, made before its TOC was parsed. Stopped when dropped
/// unused.
#[derive(Debug)]
pub struct EarlyPrefetch {
    pub range: Range<u64>,
    pub request: tokio::task::JoinHandle<Result<RangeStream, RegistryError>>,
}

impl Drop for EarlyPrefetch {
    fn drop(&mut self) {
        self.request.abort();
    }
}

impl EarlyPrefetch {
    /// Asks for bytes `range` of blob `digest`, and reads them off the wire as they come, up to
    /// `ahead` bytes before a fetch takes them.
    pub fn start(
        registry: Arc<Registry>,
        image: ImageRef,
        digest: String,
        range: Range<u64>,
        ahead: usize,
    ) -> EarlyPrefetch {
        let asked = range.clone();
        let request = tokio::spawn(async move {
            registry.blob_range_stream(&image, &digest, asked).await.map(|s| s.read_ahead(ahead))
        });
        EarlyPrefetch { range, request }
    }

    /// This request, if it is for the region the parsed TOC gives (bytes `0..end`).
    pub fn confirmed(self, end: u64, layer: &str) -> Option<EarlyPrefetch> {
        if self.range != (0..end) {
            tracing::debug!(layer, hint = ?self.range, landmark = end, "the early prefetch request was for another range");
            return None;
        }
        Some(self)
    }

    /// The answer, once it starts; `None` if the request failed.
    pub async fn answer(mut self, layer: &str) -> Option<RangeStream> {
        match (&mut self.request).await {
            Ok(Ok(stream)) => Some(stream),
            Ok(Err(e)) => {
                tracing::debug!(layer, error = %e, "the early prefetch request failed; asking again");
                None
            }
            Err(_) => None,
        }
    }
}

/// A task making early requests once it knows their ranges (the image's program's, once its
/// config is read). Dropped before its requests are taken (a layer that failed to mount), it is
/// stopped, and so are they.
#[derive(Debug)]
pub struct Asking(pub tokio::task::JoinHandle<Vec<EarlyPrefetch>>);

impl Drop for Asking {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl Asking {
    /// The requests it made; none if it failed.
    pub async fn requests(mut self) -> Vec<EarlyPrefetch> {
        (&mut self.0).await.unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};

    /// Set when the request it is part of is dropped (stopped).
    struct Stopped(Arc<AtomicBool>);

    impl Drop for Stopped {
        fn drop(&mut self) {
            self.0.store(true, Ordering::SeqCst);
        }
    }

    async fn soon(flag: &AtomicBool) -> bool {
        for _ in 0..100 {
            if flag.load(Ordering::SeqCst) {
                return true;
            }
            tokio::task::yield_now().await;
        }
        false
    }

    fn pending_request(stopped: &Arc<AtomicBool>) -> EarlyPrefetch {
        let guard = Stopped(stopped.clone());
        let request = tokio::spawn(async move {
            let _guard = guard;
            std::future::pending::<Result<RangeStream, RegistryError>>().await
        });
        EarlyPrefetch { range: 0..4096, request }
    }

    #[tokio::test]
    async fn an_early_request_for_another_region_is_stopped_not_used() {
        let stopped = Arc::new(AtomicBool::new(false));
        let early = pending_request(&stopped);
        assert!(early.confirmed(8192, "layer").is_none(), "the parsed TOC's region ends elsewhere");
        assert!(soon(&stopped).await, "the request was stopped");
    }

    #[tokio::test]
    async fn an_early_request_that_failed_is_asked_again() {
        let request = tokio::spawn(async {
            Err(RegistryError::Blob { url: "http://registry/blob".into(), reason: "refused".into() })
        });
        let early = EarlyPrefetch { range: 0..4096, request }.confirmed(4096, "layer").expect("the region confirmed");
        assert!(early.answer("layer").await.is_none());
        let stopped = Arc::new(AtomicBool::new(false));
        drop(pending_request(&stopped));
        assert!(soon(&stopped).await, "an early request dropped unused is stopped");
    }
}
