//! Whole-file copies in the hot tier: an object version laid out contiguously, without a
//! header, so the kernel can serve reads from it directly (FUSE passthrough).
//!
//! A copy is assembled only from chunks that are already in the hot tier, each one verified by
//! its CRC on the way, so it never holds bytes the cache would not serve. A file just written
//! through a mount needs no assembly: its staged file, which the chunks were cached from, is
//! moved into place as the copy. It counts against the
//! hot tier's capacity like any entry and is evicted like one, but it is derived data: it is
//! never demoted. It is fsynced before it is renamed into place, with its key in a sidecar
//! file, so a restart keeps a copy only when it is whole.

use crate::core::Core;
use crate::error::CacheError;
use crate::index::{Entry, now_ms};
use crate::key::ChunkKey;
use crate::metrics;
use crate::tier::{TierKind, in_fan_out};
use std::fs::File;
use std::io::Write;
use std::os::unix::fs::MetadataExt;
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
                // With the index lock still held: `evict` would take it again, and hang.
                self.drop_locked(&mut ix, &id, "lost");
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
        if self.resolve(&key.path).no_cache {
            return Ok(None);
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
        // Unique per attempt: two mounts sharing this cache may assemble one copy at once, and
        // must not write into each other's file.
        let tmp = dest.with_extension(format!("tmp.{}.{}.whole", std::process::id(), tier.next_tmp()));
        let io = |e| CacheError::io("assembling a whole-file copy in", tier.root(), e);
        let written = (|| -> Result<Option<u64>, std::io::Error> {
            let mut out = std::io::BufWriter::with_capacity(1 << 20, in_fan_out(&tmp, || File::create(&tmp))?);
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
        match self.install_whole(key, reservation, &tmp, total) {
            Ok(true) => {
                self.metrics.bytes_written.get_or_create(&metrics::tier(TierKind::Hot)).inc_by(total);
                Ok(Some(()))
            }
            // A copy appeared meanwhile: ours is not needed.
            Ok(false) => {
                let _ = std::fs::remove_file(&tmp);
                Ok(Some(()))
            }
            Err(e) => {
                let _ = std::fs::remove_file(&tmp);
                Err(e)
            }
        }
    }

    /// Takes the file at `from`, whose bytes are the object version `key` names (a checkpoint's
    /// staged copy, just uploaded), as that version's whole-file copy by renaming it into the
    /// hot tier, so it is not written a second time. The caller vouches for the content, as it
    /// does for the chunks it stores from the same bytes. `Ok(false)`, leaving `from` alone,
    /// when it cannot be moved there (another file system, a different length): the copy is
    /// then assembled from the chunks as usual.
    pub fn adopt_whole(&self, key: &ChunkKey, from: &std::path::Path) -> Result<bool, CacheError> {
        let crate::key::Identity::File { size, .. } = key.identity else { return Ok(false) };
        if self.contains(&key.id()) {
            return Ok(true);
        }
        if self.resolve(&key.path).no_cache {
            return Ok(false);
        }
        let io = |e| CacheError::io("adopting a whole-file copy from", from, e);
        let file = File::open(from).map_err(io)?;
        let meta = file.metadata().map_err(io)?;
        let tier = self.tier(TierKind::Hot)?;
        // A rename cannot cross file systems; checked before the sync, which would be wasted.
        let same_fs = std::fs::metadata(tier.root()).is_ok_and(|t| t.dev() == meta.dev());
        if meta.len() != size || !same_fs {
            return Ok(false);
        }
        let reservation = self.reserve(TierKind::Hot, size)?;
        // Staged bytes that went up while being written were never synced; a restart must not
        // keep a copy that a crash tore.
        file.sync_all().map_err(io)?;
        match self.install_whole(key, reservation, from, size) {
            // Another mount of the same file system (a bind mount) refuses it too.
            Err(CacheError::Io { source, .. }) if source.kind() == std::io::ErrorKind::CrossesDevices => Ok(false),
            Ok(true) => {
                debug!(file = %key, "staged file taken as the whole-file copy");
                Ok(true)
            }
            // A copy of this version was already there; `from` stays with its owner.
            Ok(false) => Ok(true),
            Err(e) => Err(e),
        }
    }

    /// Renames the complete, synced file `from` into place as the whole-file copy `key`, with
    /// its key in a sidecar for restarts, and indexes it. `Ok(false)`, leaving `from`, when a
    /// copy of `key` is already there.
    fn install_whole(
        &self,
        key: &ChunkKey,
        reservation: crate::core::Reservation<'_>,
        from: &std::path::Path,
        total: u64,
    ) -> Result<bool, CacheError> {
        let id = key.id();
        let tier = self.tier(TierKind::Hot)?;
        let dest = tier.entry_path(&id, key);
        let io = |e| CacheError::io("installing a whole-file copy in", tier.root(), e);
        let sidecar = dest.with_extension(crate::tier::WHOLE_KEY_EXT);
        in_fan_out(&sidecar, || File::create(&sidecar))
            .and_then(|mut f| f.write_all(&serde_json::to_vec(key).expect("keys serialize")))
            .map_err(io)?;
        let mut ix = self.lock();
        if ix.entries.contains_key(&id) {
            return Ok(false);
        }
        if let Err(e) = std::fs::rename(from, &dest) {
            let _ = std::fs::remove_file(&sidecar);
            return Err(io(e));
        }
        reservation.settle(&mut ix);
        let now = now_ms();
        let pin = self.resolve(&key.path).pin;
        ix.insert(id, Entry::new(key.clone(), TierKind::Hot, total, total, now, pin));
        self.update_gauges(&ix);
        Ok(true)
    }
}
