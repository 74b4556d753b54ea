//! What keeps written checkpoints hot: pins on the newest entry of each directory, moving a
//! renamed file's cached chunks to its new name, and asking for whole-file copies. Shared by the
//! core and the background tasks it starts, so a rename need not wait for any of it.

use crate::namespace::{Namespace, Node};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use strata_tiering::TieredCache;

pub(crate) struct Keeper {
    pub ns: Arc<dyn Namespace>,
    pub cache: TieredCache,
    pub keep_newest_hot: bool,
    pub checkpoint_window: Duration,
    /// When this mount first began writing a file in each directory, to tell checkpoint
    /// directories from directories of checkpoints.
    pub first_write: Mutex<HashMap<String, Instant>>,
    /// Orders the caching of a closed file's staged bytes before the move of those chunks to a
    /// new name, so a rename right after close finds them.
    pub order: tokio::sync::Mutex<()>,
    /// Files to assemble whole-file copies of, for passthrough; one worker drains it.
    pub assemble: Option<tokio::sync::mpsc::UnboundedSender<(String, Node)>>,
}

impl Keeper {
    pub fn request_whole(&self, path: &str, node: &Node) {
        if let Some(q) = &self.assemble
            && node.size > 0
            && !node.version.is_empty()
        {
            let _ = q.send((path.to_string(), node.clone()));
        }
    }

    /// A file under `path` is being written from now on. The time counts when it began, not
    /// when its upload and caching were done, which a busy node may delay.
    pub fn note_write(&self, path: &str, node: &Node) {
        if let Some((_, key_dir)) = self.key_dir(path, node) {
            let mut first = self.first_write.lock().unwrap_or_else(|p| p.into_inner());
            first.entry(key_dir).or_insert_with(Instant::now);
        }
    }

    /// The file's key path and the directory part of it, which pins and checkpoint windows
    /// are kept by.
    fn key_dir(&self, path: &str, node: &Node) -> Option<(String, String)> {
        let key_path = self.ns.chunk_key(path, node, 0).path;
        let (dir, _) = key_path.rsplit_once('/')?;
        let dir = dir.to_string();
        Some((key_path, dir))
    }

    /// Pins a just-written file, begun at `written`, as the newest entry of its directory. If
    /// the directory is itself one checkpoint (all begun within the checkpoint window), the
    /// whole directory is pinned as the newest entry of its parent instead of the previous one
    /// there, and the older step directories' pins go. A directory written into over a longer
    /// time is a directory of checkpoints and loses such a pin. A pin that does not fit is only
    /// logged: the write itself has succeeded.
    pub async fn keep_newest(&self, path: &str, node: &Node, written: Instant) {
        if !self.keep_newest_hot {
            return;
        }
        let Some((key_path, key_dir)) = self.key_dir(path, node) else { return };
        let key_parent = key_dir.rsplit_once('/').map(|(p, _)| p.to_string());
        let fresh = {
            let mut first = self.first_write.lock().unwrap_or_else(|p| p.into_inner());
            let began = first.entry(key_dir.clone()).or_insert(written);
            *began = (*began).min(written);
            written.saturating_duration_since(*began) < self.checkpoint_window
        };
        // The directory's pins first, the file's last: whoever sees the file pinned sees the
        // directory's standing settled too (a directory of checkpoints is not pinned whole).
        if let Some(parent) = key_parent {
            let dir_pattern = format!("{key_dir}/");
            if fresh {
                self.pin_newest(&parent, &dir_pattern).await;
                let (under, keep) = (format!("{parent}/"), key_dir.clone());
                let _ = self.cache.unpin_newest(move |g| g.starts_with(&under) && g != keep).await;
            } else {
                let pinned_here =
                    self.cache.pins().iter().any(|p| {
                        p.newest_of.as_deref() == Some(parent.as_str()) && p.pattern.to_string() == dir_pattern
                    });
                if pinned_here {
                    let _ = self.cache.unpin_newest(move |g| g == parent).await;
                }
            }
        }
        self.pin_newest(&key_dir, &format!("={key_path}")).await;
    }

    pub async fn pin_newest(&self, group: &str, pattern: &str) {
        let Ok(p) = strata_tiering::PathPattern::parse(pattern) else { return };
        if let Err(e) = self.cache.pin_newest(group, p).await {
            tracing::warn!(path = %pattern, error = %e, "cannot keep the newest checkpoint hot");
        }
    }

    /// After a rename of a published file, moves its cached chunks to the keys of the new
    /// name, so a checkpoint written to a temp name and renamed stays hot under its real name.
    /// Only when the copy is known to be of the version cached: one whose store answered with
    /// another version may be of an object another client wrote meanwhile, even of the same
    /// size, and the cached bytes would then be served as its content.
    pub async fn rekey_cached(&self, from: &str, old: &Node, to: &str, new: &Node) {
        if old.size != new.size || new.version.is_empty() || new.version != old.version {
            return;
        }
        // After any caching of the closed file's bytes under the old name has finished.
        let _order = self.order.lock().await;
        let chunk = self.ns.chunk_size().max(1);
        for i in 0..new.size.div_ceil(chunk) {
            let old_key = self.ns.chunk_key(from, old, i);
            let Some(bytes) = self.cache.get_local_blocking(&old_key) else { return };
            let new_key = self.ns.chunk_key(to, new, i);
            if self.cache.put(new_key, bytes, strata_tiering::TierKind::Hot).await.is_err() {
                return;
            }
        }
        let (old_path, new_path) = (self.ns.chunk_key(from, old, 0).path, self.ns.chunk_key(to, new, 0).path);
        if new_path != old_path {
            let (whole, mut stale) = crate::assemble::keys(self.ns.as_ref(), from, old);
            stale.push(whole);
            let _ = self.cache.discard(stale).await;
        }
        self.keep_newest(to, new, Instant::now()).await;
        self.request_whole(to, new);
    }
}
