//! The worker that assembles whole-file copies of files whose chunks are all in the hot tier,
//! so later opens can pass reads through to the kernel. One file at a time, in the background:
//! a copy is an optimisation for the next open, never something a reader waits for.

use crate::namespace::{Namespace, Node};
use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;
use strata_tiering::{ChunkKey, TieredCache};
use tracing::debug;

/// The whole-file key of a file and the keys of its chunks, in order.
pub fn keys(ns: &dyn Namespace, path: &str, node: &Node) -> (ChunkKey, Vec<ChunkKey>) {
    let chunk = ns.chunk_size().max(1);
    let n = node.size.div_ceil(chunk);
    let chunks: Vec<ChunkKey> = (0..n).map(|i| ns.chunk_key(path, node, i)).collect();
    let logical = chunks.first().map(|k| k.path.clone()).unwrap_or_else(|| path.to_string());
    (ChunkKey::whole(logical, &node.version, node.size), chunks)
}

/// Starts the worker on the current runtime; `None` outside one (then there is no passthrough).
pub fn start(ns: Arc<dyn Namespace>, cache: TieredCache) -> Option<tokio::sync::mpsc::UnboundedSender<(String, Node)>> {
    let rt = tokio::runtime::Handle::try_current().ok()?;
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(String, Node)>();
    let requeue = tx.downgrade();
    rt.spawn(async move {
        // Versions already assembled recently, so repeated opens of a file cost one index check
        // each, not one assembly attempt each. The check does not open the copy: that would
        // count a second access to it for every open, in the policy's eyes.
        let mut done: HashSet<ChunkKey> = HashSet::new();
        // Files found not all hot once, which get one more try after the cache's pending writes.
        let mut retried: HashSet<ChunkKey> = HashSet::new();
        while let Some((path, node)) = rx.recv().await {
            let (whole, chunks) = keys(ns.as_ref(), &path, &node);
            if done.contains(&whole) && cache.location(&whole).is_some() {
                continue;
            }
            // The chunks of a read that just ended may still be on their way into the hot tier.
            cache.settled(&chunks, Duration::from_secs(10)).await;
            match cache.build_whole(whole.clone(), chunks).await {
                Ok(true) => {
                    debug!(file = %whole, "whole-file copy ready for passthrough");
                    retried.remove(&whole);
                    done.insert(whole);
                }
                // Chunks coming up from warm are moved by background promotions: try once more
                // after those, behind what is queued.
                Ok(false) if retried.insert(whole.clone()) => {
                    if rx.is_empty() {
                        cache.wait_background(Duration::from_secs(5)).await;
                    }
                    if let Some(tx) = requeue.upgrade() {
                        let _ = tx.send((path, node));
                    }
                }
                Ok(false) => {}
                Err(e) => debug!(file = %whole, error = %e, "no whole-file copy"),
            }
            if done.len() > 100_000 {
                done.clear();
            }
            if retried.len() > 100_000 {
                retried.clear();
            }
        }
    });
    Some(tx)
}
