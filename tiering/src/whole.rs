//! Whole-file copies in the hot tier: an object version laid out contiguously, without a
//! header, so the kernel can serve reads from it directly (FUSE passthrough).
//!
//! A copy is assembled only from chunks that are already in the hot tier, each one verified by
//! its CRC on the way, so it never holds bytes the cache would not serve. It counts against the
//! hot tier's capacity like any entry and is evicted like one, but it is derived data: it is
//! never demoted. It is fsynced before it is renamed into place, with its key in a sidecar
//! file, so a restart keeps a copy only when it is whole.

use crate::core::Core;
use crate::error::CacheError;
use crate::index::{Entry, now_ms};
use crate::key::ChunkKey;
use crate::metrics;
use crate::tier::TierKind;
use std::fs::File;
use std::io::Write;
use tracing::debug;

impl Core {
    /// Opens the whole-file copy named by `key` if the hot tier has it, counting the open as an
    /// access so the policy sees it.
    pub fn open_whole(&self, key: &ChunkKey) -> Option<File> {
        let id = key.id();
        let half_life = self.half_life_ms();
        let mut ix = self.lock();
        let e = ix.entries.get_mut(&id).filter(|e| e.tier == TierKind::Hot && !e.moving)?;
        let path = self.tiers[TierKind::Hot.index()].as_ref()?.entry_path(&id, key);
        // Opened under the index lock, like chunk reads, so an eviction cannot pull the file
        // away between the lookup and the open.
        match File::open(&path) {
            Ok(f) => {
                e.touch(now_ms(), half_life);
                Some(f)
            }
            Err(err) => {
                debug!(file = %key, error = %err, "whole-file copy vanished");
                self.evict(&id, "lost");
                None
            }
        }
    }

    /// Counts an access to each chunk without reading it: opens served by the kernel directly
    /// still make the data hot in the policy's eyes.
    pub fn touch(&self, keys: &[ChunkKey]) {
        let now = now_ms();
        let half_life = self.half_life_ms();
        let mut ix = self.lock();
        for k in keys {
            if let Some(e) = ix.entries.get_mut(&k.id()) {
                e.touch(now, half_life);
            }
        }
    }

    /// Assembles the whole-file copy `key` from `chunks`, in order. Returns `None`, writing
    /// nothing, unless every chunk is in the hot tier and verifies.
    pub fn build_whole(&self, key: &ChunkKey, chunks: &[ChunkKey]) -> Result<Option<()>, CacheError> {
        let crate::key::Identity::File { size, .. } = key.identity else { return Ok(None) };
        let id = key.id();
        if self.contains(&id) {
            return Ok(Some(()));
        }
        let all_hot = {
            let ix = self.lock();
            chunks.iter().all(|c| ix.entries.get(&c.id()).is_some_and(|e| e.tier == TierKind::Hot))
        };
        if !all_hot {
            return Ok(None);
        }
        let tier = self.tier(TierKind::Hot)?;
        let reservation = self.reserve(TierKind::Hot, size)?;
        let dest = tier.entry_path(&id, key);
        let tmp = dest.with_extension(format!("tmp.{}.whole", std::process::id()));
        let io = |e| CacheError::io("assembling a whole-file copy in", tier.root(), e);
        if let Some(dir) = dest.parent() {
            std::fs::create_dir_all(dir).map_err(io)?;
        }
        let written = (|| -> Result<Option<u64>, std::io::Error> {
            let mut out = std::io::BufWriter::with_capacity(1 << 20, File::create(&tmp)?);
            let mut total = 0;
            for c in chunks {
                // A chunk evicted meanwhile, or one failing its CRC, ends the attempt: the copy
                // must hold only verified bytes.
                let Some(hit) = self.lookup(c, &c.id()) else { return Ok(None) };
                out.write_all(&hit.bytes)?;
                total += hit.bytes.len() as u64;
            }
            out.into_inner().map_err(|e| e.into_error())?.sync_all()?;
            Ok(Some(total))
        })();
        let total = match written {
            Ok(Some(t)) if t == size => t,
            Ok(_) => {
                let _ = std::fs::remove_file(&tmp);
                return Ok(None);
            }
            Err(e) => {
                let _ = std::fs::remove_file(&tmp);
                self.metrics.write_errors.get_or_create(&metrics::tier(TierKind::Hot)).inc();
                return Err(io(e));
            }
        };
        let sidecar = dest.with_extension(crate::tier::WHOLE_KEY_EXT);
        let key_json = serde_json::to_vec(key).expect("keys serialize");
        if let Err(e) = std::fs::write(&sidecar, key_json) {
            let _ = std::fs::remove_file(&tmp);
            return Err(io(e));
        }
        let mut ix = self.lock();
        if ix.entries.contains_key(&id) {
            let _ = std::fs::remove_file(&tmp);
            return Ok(Some(()));
        }
        if let Err(e) = std::fs::rename(&tmp, &dest) {
            let _ = std::fs::remove_file(&tmp);
            let _ = std::fs::remove_file(&sidecar);
            return Err(io(e));
        }
        reservation.settle(&mut ix);
        let now = now_ms();
        let pin = self.resolve(&key.path).pin;
        ix.insert(id, Entry::new(key.clone(), TierKind::Hot, total, total, now, pin));
        self.metrics.bytes_written.get_or_create(&metrics::tier(TierKind::Hot)).inc_by(total);
        self.update_gauges(&ix);
        Ok(Some(()))
    }
}
