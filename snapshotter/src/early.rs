//! Requests for a layer's prefetch region made before its TOC is parsed, so the link carries
//! the start-up files while the TOC is still on its way or being read. The region starts at the
//! blob's first byte and ends where the descriptor's hint or the landmark's own TOC entry says.
//! Whatever a request brings is checked chunk by chunk against the parsed TOC before it is
//! cached, and a request the parse does not confirm is stopped.

use crate::registry::range_stream::RangeStream;
use crate::registry::{ImageRef, Registry, RegistryError};
use std::sync::Arc;

/// The request for a layer's prefetch region, made before its TOC was parsed: bytes `0..end`.
/// Stopped when dropped unused.
#[derive(Debug)]
pub struct EarlyPrefetch {
    pub end: u64,
    pub request: tokio::task::JoinHandle<Result<RangeStream, RegistryError>>,
}

impl Drop for EarlyPrefetch {
    fn drop(&mut self) {
        self.request.abort();
    }
}

impl EarlyPrefetch {
    /// Asks for bytes `0..end` of blob `digest`, and reads them off the wire as they come, up to
    /// `ahead` bytes before the fill takes them.
    pub fn start(registry: Arc<Registry>, image: ImageRef, digest: String, end: u64, ahead: usize) -> EarlyPrefetch {
        let request = tokio::spawn(async move {
            registry.blob_range_stream(&image, &digest, 0..end).await.map(|s| s.read_ahead(ahead))
        });
        EarlyPrefetch { end, request }
    }

    /// This request, if it is for the region the parsed TOC gives (bytes `0..end`).
    pub fn confirmed(self, end: u64, layer: &str) -> Option<EarlyPrefetch> {
        if self.end != end {
            tracing::debug!(layer, hint = self.end, landmark = end, "the early prefetch request was for another range");
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
        EarlyPrefetch { end: 4096, request }
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
        let early = EarlyPrefetch { end: 4096, request }.confirmed(4096, "layer").expect("the region confirmed");
        assert!(early.answer("layer").await.is_none());
        let stopped = Arc::new(AtomicBool::new(false));
        drop(pending_request(&stopped));
        assert!(soon(&stopped).await, "an early request dropped unused is stopped");
    }
}
