//! The synchronous heart of the cache: lookups, stores, reservations, and moves between tiers.
//!
//! Every index change that touches a chunk's file name (rename into place, unlink) happens under
//! the index lock, and readers open their file under the same lock. So a reader always holds an
//! open descriptor of the file the index pointed at, and eviction can unlink it at once: the
//! bytes stay readable through the descriptor until the read ends.

use crate::chunkfile::{self, ChunkFileError};
use crate::error::CacheError;
use crate::index::{Entry, Index, now_ms};
use crate::key::{ChunkKey, KeyId};
use crate::metrics::{self, EvictLabel, Metrics};
use crate::pattern::PathPattern;
use crate::policy::{Policy, Resolved};
use crate::tier::{Tier, TierKind};
use bytes::Bytes;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::fs::File;
use std::path::PathBuf;
use std::sync::{Mutex, MutexGuard, RwLock};
use std::time::Duration;
use tracing::{debug, warn};

/// A pin set from the CLI or admin API, kept in the state dir.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Pin {
    pub pattern: PathPattern,
    pub tier: TierKind,
    /// Set for the pin that keeps the newest file written into a directory hot: the directory.
    /// A newer write there replaces the pin.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub newest_of: Option<String>,
}

#[derive(Debug)]
pub(crate) struct Core {
    pub tiers: [Option<Tier>; 2],
    pub index: Mutex<Index>,
    pub policy: RwLock<Policy>,
    pub pins: RwLock<Vec<Pin>>,
    /// Counts refreshes of every entry's pin (after the pins or the policy changed), so that a
    /// store can tell that the pin it resolved may be stale.
    pub pin_refreshes: std::sync::atomic::AtomicU64,
    /// Held while the pins are changed and saved, so saves land in the order of the changes;
    /// the pins' own lock is not held while they are written to disk.
    pub pins_saving: std::sync::Mutex<()>,
    pub metrics: Metrics,
    pub state_dir: PathBuf,
    /// Held for the cache's lifetime: two processes sharing tier directories would each
    /// account and evict the other's files.
    pub _lock: File,
}

/// What a lookup found.
pub(crate) struct Hit {
    pub bytes: Bytes,
    pub promote: bool,
}

/// Bytes set aside in a tier for a chunk being written. Dropping it returns them.
pub(crate) struct Reservation<'a> {
    core: &'a Core,
    tier: TierKind,
    bytes: u64,
}

impl Reservation<'_> {
    /// Hands the reserved bytes over to an entry that now counts them as used.
    pub(crate) fn settle(self, ix: &mut Index) {
        ix.reserved[self.tier.index()] -= self.bytes;
        std::mem::forget(self);
    }
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        self.core.lock().reserved[self.tier.index()] -= self.bytes;
    }
}

impl Core {
    pub fn lock(&self) -> MutexGuard<'_, Index> {
        // A panic while holding the lock leaves the index consistent at worst with stale
        // accounting, which the next scan repairs; keep serving rather than poison every reader.
        self.index.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn tier(&self, t: TierKind) -> Result<&Tier, CacheError> {
        self.tiers[t.index()].as_ref().ok_or(CacheError::NoSuchTier(t))
    }

    pub(crate) fn has(&self, t: TierKind) -> bool {
        self.tiers[t.index()].is_some()
    }

    pub fn policy(&self) -> std::sync::RwLockReadGuard<'_, Policy> {
        self.policy.read().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn half_life_ms(&self) -> f64 {
        self.policy().lrfu_half_life.0.as_millis() as f64
    }

    /// The policy for a path, with CLI pins taking precedence over policy rules.
    pub fn resolve(&self, path: &str) -> Resolved {
        let mut r = self.policy().resolve(path);
        let pins = self.pins.read().unwrap_or_else(|p| p.into_inner());
        if let Some(p) = pins.iter().rev().find(|p| p.pattern.matches(path)) {
            r.pin = Some(p.tier);
            r.no_cache = false;
        }
        r
    }

    /// Changes the pin set with `change` and saves it, durably. Readers of the pins (every
    /// store resolves its chunk's pin) wait only for the change, not for the disk.
    pub fn change_pins<T>(&self, change: impl FnOnce(&mut Vec<Pin>) -> T) -> Result<T, CacheError> {
        let _saving = self.pins_saving.lock().unwrap_or_else(|p| p.into_inner());
        let (out, now) = {
            let mut pins = self.pins.write().unwrap_or_else(|p| p.into_inner());
            let before = pins.clone();
            let out = change(&mut pins);
            if *pins == before {
                return Ok(out);
            }
            (out, pins.clone())
        };
        crate::restore::save_pins(&self.state_dir, &now)?;
        Ok(out)
    }

    /// Recomputes every entry's pin after the policy or the pin set changed.
    pub fn refresh_pins(&self) {
        // Counted before the index is taken: a store that took it first is refreshed here, and
        // one that takes it after sees the count moved.
        self.pin_refreshes.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let mut ix = self.lock();
        for e in ix.entries.values_mut() {
            e.pin = self.resolve(&e.key.path).pin;
        }
    }

    pub fn update_gauges(&self, ix: &Index) {
        for t in TierKind::ALL {
            if self.has(t) {
                self.metrics.used.get_or_create(&metrics::tier(t)).set(ix.used[t.index()] as i64);
                self.metrics.chunks.get_or_create(&metrics::tier(t)).set(ix.chunks[t.index()] as i64);
            }
        }
    }

    pub(crate) fn count_misses(&self, tiers: &[TierKind]) {
        for &t in tiers {
            if self.has(t) {
                self.metrics.misses.get_or_create(&metrics::tier(t)).inc();
            }
        }
    }

    /// Removes an entry and unlinks its file; the caller holds the lock.
    pub(crate) fn drop_locked(&self, ix: &mut Index, id: &KeyId, reason: &'static str) -> Option<Entry> {
        let e = ix.remove(id)?;
        if let Ok(t) = self.tier(e.tier) {
            let path = t.entry_path(id, &e.key);
            if e.key.is_whole() {
                let _ = std::fs::remove_file(path.with_extension(crate::tier::WHOLE_KEY_EXT));
            }
            if let Err(err) = std::fs::remove_file(&path)
                && err.kind() != std::io::ErrorKind::NotFound
            {
                warn!(path = %path.display(), error = %err, "could not unlink evicted chunk");
            }
        }
        self.metrics.evictions.get_or_create(&EvictLabel { tier: e.tier.as_str(), reason }).inc();
        self.metrics.evicted_chunks.inc();
        self.update_gauges(ix);
        Some(e)
    }

    pub fn evict(&self, id: &KeyId, reason: &'static str) -> Option<Entry> {
        let mut ix = self.lock();
        self.drop_locked(&mut ix, id, reason)
    }

    /// Drops an entry the policy claimed, unless a pin reached it after the claim: a pin made
    /// while a pass holds thousands of victims must still keep every chunk it names. Such an
    /// entry is only released.
    pub fn evict_unpinned(&self, id: &KeyId, reason: &'static str) -> Option<Entry> {
        let mut ix = self.lock();
        match ix.entries.get_mut(id) {
            Some(e) if e.pin.is_some() => {
                e.moving = false;
                None
            }
            Some(_) => self.drop_locked(&mut ix, id, reason),
            None => None,
        }
    }

    /// Looks a chunk up in hot, then warm, and returns its verified bytes.
    pub fn lookup(&self, key: &ChunkKey, id: &KeyId) -> Option<Hit> {
        self.lookup_with(key, id, chunkfile::read_verified_file)
    }

    /// As [`Core::lookup`], for the bytes `range` of the chunk only: a small read of a large
    /// chunk loads and checks the pieces it touches, not the whole chunk.
    pub fn lookup_range(&self, key: &ChunkKey, id: &KeyId, range: std::ops::Range<u64>) -> Option<Hit> {
        self.lookup_with(key, id, |f, id, len| chunkfile::read_verified_range(f, id, len, range))
    }

    fn lookup_with(
        &self,
        key: &ChunkKey,
        id: &KeyId,
        read: impl FnOnce(File, KeyId, u64) -> Result<Bytes, ChunkFileError>,
    ) -> Option<Hit> {
        if key.is_whole() {
            // Whole-file copies have no header to verify; they are opened, never read here.
            return None;
        }
        let now = now_ms();
        let half_life = self.half_life_ms();
        let (file, tier, generation, pin, disk_len) = {
            let mut ix = self.lock();
            let Some(e) = ix.entries.get_mut(id) else {
                drop(ix);
                self.count_misses(&TierKind::ALL);
                return None;
            };
            let (tier, inserted, pin) = (e.tier, e.inserted_ms, e.pin);
            let ttl = if pin.is_none() { self.policy().resolve(&key.path).ttl } else { None };
            if ttl.is_some_and(|ttl| now.saturating_sub(inserted) > ttl.as_millis() as u64) {
                self.drop_locked(&mut ix, id, "ttl");
                drop(ix);
                self.count_misses(&TierKind::ALL);
                return None;
            }
            let path = self.tiers[tier.index()].as_ref().map(|t| t.chunk_path(id));
            match path.map(File::open) {
                Some(Ok(f)) => {
                    let e = ix.entries.get_mut(id).expect("entry checked above");
                    e.touch(now, half_life);
                    (f, e.tier, e.generation, e.pin, e.disk_len)
                }
                other => {
                    if let Some(Err(err)) = other {
                        warn!(chunk = %key, error = %err, "cached chunk file vanished; refetching");
                    }
                    self.drop_locked(&mut ix, id, "lost");
                    drop(ix);
                    self.count_misses(&TierKind::ALL);
                    return None;
                }
            }
        };
        match read(file, *id, disk_len) {
            Ok(bytes) => {
                if tier == TierKind::Warm {
                    self.count_misses(&[TierKind::Hot]);
                }
                let label = metrics::tier(tier);
                self.metrics.hits.get_or_create(&label).inc();
                self.metrics.bytes_read.get_or_create(&label).inc_by(bytes.len() as u64);
                let promote = tier == TierKind::Warm && self.has(TierKind::Hot) && pin != Some(TierKind::Warm);
                Some(Hit { bytes, promote })
            }
            Err(err) => {
                if !matches!(err, ChunkFileError::Io(_)) {
                    self.metrics.checksum_failures.get_or_create(&metrics::tier(tier)).inc();
                }
                warn!(chunk = %key, tier = %tier, error = %err, "cached chunk failed verification; refetching");
                let mut ix = self.lock();
                if ix.entries.get(id).is_some_and(|e| e.generation == generation) {
                    self.drop_locked(&mut ix, id, "corrupt");
                }
                drop(ix);
                self.count_misses(&TierKind::ALL);
                None
            }
        }
    }

    pub fn contains(&self, id: &KeyId) -> bool {
        self.lock().entries.contains_key(id)
    }

    /// Sets aside `bytes` in `tier`, moving entries out first if needed. Fails only when
    /// everything left is pinned or too big to fit.
    pub fn reserve(&self, tier: TierKind, bytes: u64) -> Result<Reservation<'_>, CacheError> {
        let t = self.tier(tier)?;
        let cap = t.capacity();
        let how = self.policy().eviction;
        let half_life = self.half_life_ms();
        for round in 0..64 {
            let victims = {
                let mut ix = self.lock();
                let i = tier.index();
                let total = ix.used[i] + ix.reserved[i] + bytes;
                if total <= cap {
                    ix.reserved[i] += bytes;
                    return Ok(Reservation { core: self, tier, bytes });
                }
                let target = t.high_bytes().min(cap.saturating_sub(bytes));
                let need = total.saturating_sub(target).max(total - cap);
                let v = ix.victims(tier, need, how, half_life);
                let freeable: u64 = v.iter().map(|id| ix.entries[id].disk_len).sum();
                let busy = ix.entries.values().any(|e| e.tier == tier && e.moving);
                if freeable + cap < total && !busy || bytes > cap {
                    return Err(CacheError::TierFull {
                        tier,
                        used: ix.used[i] + ix.reserved[i],
                        capacity: cap,
                        pinned: ix.pinned_bytes(tier),
                    });
                }
                for id in &v {
                    ix.entries.get_mut(id).expect("victim is present").moving = true;
                }
                v
            };
            if victims.is_empty() {
                // Others are moving entries out of this tier right now; give them a moment.
                std::thread::sleep(Duration::from_millis(1 + round));
                continue;
            }
            for id in victims {
                self.move_out(tier, &id);
            }
        }
        let ix = self.lock();
        Err(CacheError::TierFull {
            tier,
            used: ix.used[tier.index()] + ix.reserved[tier.index()],
            capacity: cap,
            pinned: ix.pinned_bytes(tier),
        })
    }

    /// Frees a victim's place in `tier`: hot victims go down to warm, warm victims are dropped.
    fn move_out(&self, tier: TierKind, id: &KeyId) {
        if tier == TierKind::Hot && self.has(TierKind::Warm) {
            self.relocate(id, TierKind::Hot, TierKind::Warm);
        } else {
            self.evict_unpinned(id, "capacity");
        }
    }

    /// Copies a chunk from one tier to the other and switches the index to the copy. Any failure
    /// on the way drops the chunk instead, which is always safe for a cache.
    pub fn relocate(&self, id: &KeyId, from: TierKind, to: TierKind) -> bool {
        let Ok(dest) = self.tier(to) else {
            if let Some(e) = self.lock().entries.get_mut(id) {
                e.moving = false;
            }
            return false;
        };
        let snapshot = {
            let mut ix = self.lock();
            let Some(e) = ix.entries.get_mut(id) else { return false };
            if e.tier != from {
                e.moving = false;
                return false;
            }
            if e.key.is_whole() {
                // A whole-file copy duplicates chunks; leaving its tier just drops it.
                self.drop_locked(&mut ix, id, "whole-copy");
                return false;
            }
            e.moving = true;
            let path = self.tiers[from.index()].as_ref().map(|t| t.chunk_path(id));
            match path.map(File::open) {
                Some(Ok(f)) => (f, e.key.clone(), e.generation, e.disk_len),
                _ => {
                    self.drop_locked(&mut ix, id, "lost");
                    return false;
                }
            }
        };
        let (file, key, generation, disk_len) = snapshot;
        // A chunk file's mtime is when it was cached, which a restart reads back for TTLs
        // ("counted from when it was cached"): the moved copy keeps it.
        let cached_at = file.metadata().and_then(|m| m.modified()).ok();
        // Room first: a move that cannot happen should not cost a read of the chunk.
        let reservation = match self.reserve(to, disk_len) {
            Ok(r) => r,
            Err(err) => {
                debug!(chunk = %key, error = %err, "no room to move chunk");
                self.abandon_move(id, generation, from, "capacity");
                return false;
            }
        };
        let data = match chunkfile::read_verified_file(file, *id, disk_len) {
            Ok(d) => d,
            Err(err) => {
                if !matches!(err, ChunkFileError::Io(_)) {
                    self.metrics.checksum_failures.get_or_create(&metrics::tier(from)).inc();
                }
                warn!(chunk = %key, tier = %from, error = %err, "dropping a chunk that failed verification while moving");
                self.drop_if_current(id, generation, "corrupt");
                return false;
            }
        };
        let (tmp, len) = match dest.write_tmp(id, &key, &data) {
            Ok(x) => x,
            Err(err) => {
                self.metrics.write_errors.get_or_create(&metrics::tier(to)).inc();
                warn!(chunk = %key, tier = %to, error = %err, "writing a moved chunk failed");
                self.abandon_move(id, generation, from, "write-error");
                return false;
            }
        };
        if let Some(t) = cached_at
            && let Err(err) = File::options().write(true).open(&tmp).and_then(|f| f.set_modified(t))
        {
            debug!(chunk = %key, error = %err, "the moved chunk's cache time was not kept");
        }
        let mut ix = self.lock();
        let current = ix.entries.get(id).is_some_and(|e| e.generation == generation && e.tier == from);
        if !current {
            let _ = std::fs::remove_file(&tmp);
            return false;
        }
        if let Err(err) = dest.commit(&tmp, id) {
            self.metrics.write_errors.get_or_create(&metrics::tier(to)).inc();
            warn!(chunk = %key, tier = %to, error = %err, "renaming a moved chunk failed");
            drop(ix);
            self.abandon_move(id, generation, from, "write-error");
            return false;
        }
        if let Ok(src) = self.tier(from) {
            let _ = std::fs::remove_file(src.chunk_path(id));
        }
        reservation.settle(&mut ix);
        ix.relocate(id, to, len);
        self.metrics.bytes_written.get_or_create(&metrics::tier(to)).inc_by(data.len() as u64);
        if to == TierKind::Hot {
            self.metrics.promotions.inc();
        } else {
            self.metrics.demotions.inc();
        }
        self.update_gauges(&ix);
        true
    }

    /// A move that could not complete. A demotion with nowhere to go is an eviction, but only
    /// for unpinned chunks; anything else stays where it is, still readable.
    fn abandon_move(&self, id: &KeyId, generation: u64, from: TierKind, reason: &'static str) {
        let mut ix = self.lock();
        let Some(e) = ix.entries.get_mut(id).filter(|e| e.generation == generation) else { return };
        if from == TierKind::Hot && e.pin.is_none() {
            self.drop_locked(&mut ix, id, reason);
        } else {
            e.moving = false;
        }
    }

    fn drop_if_current(&self, id: &KeyId, generation: u64, reason: &'static str) {
        let mut ix = self.lock();
        if ix.entries.get(id).is_some_and(|e| e.generation == generation) {
            self.drop_locked(&mut ix, id, reason);
        }
    }

    /// Moves a warm chunk up to hot, unless another move already claimed it.
    pub fn promote(&self, id: &KeyId) -> bool {
        {
            let mut ix = self.lock();
            match ix.entries.get_mut(id) {
                Some(e) if e.tier == TierKind::Warm && !e.moving => e.moving = true,
                _ => return false,
            }
        }
        self.relocate(id, TierKind::Warm, TierKind::Hot)
    }

    /// Writes fetched bytes into `tier` and indexes them.
    pub fn store(&self, key: &ChunkKey, data: &[u8], tier: TierKind) -> Result<(), CacheError> {
        let t = self.tier(tier)?;
        let id = key.id();
        // A key names one content (a digest, or a chunk of one object version), so a copy
        // already in this tier is these bytes: a fetch that found them cached by a read-around
        // must not write them again.
        if self.lock().entries.get(&id).is_some_and(|e| e.tier == tier) {
            return Ok(());
        }
        let disk = chunkfile::encoded_len(key, data.len() as u64);
        let reservation = self.reserve(tier, disk)?;
        let (tmp, len) = t.write_tmp(&id, key, data).map_err(|e| {
            self.metrics.write_errors.get_or_create(&metrics::tier(tier)).inc();
            CacheError::io("writing chunk into", t.root(), e)
        })?;
        // Resolved outside the index lock: a pin change holds the pins' lock while it saves
        // them to disk, and every read and store would wait behind this one. A refresh of the
        // pins that ran meanwhile, before this entry was in, is caught by its count.
        let refreshes = self.pin_refreshes.load(std::sync::atomic::Ordering::SeqCst);
        let mut pin = self.resolve(&key.path).pin;
        let mut ix = self.lock();
        if self.pin_refreshes.load(std::sync::atomic::Ordering::SeqCst) != refreshes {
            pin = self.resolve(&key.path).pin;
        }
        if let Some(old) = ix.entries.get(&id) {
            if old.tier == tier {
                // Someone else stored the same bytes meanwhile; theirs is as good as ours.
                let _ = std::fs::remove_file(&tmp);
                return Ok(());
            }
            self.drop_locked(&mut ix, &id, "replaced");
        }
        t.commit(&tmp, &id).map_err(|e| {
            self.metrics.write_errors.get_or_create(&metrics::tier(tier)).inc();
            CacheError::io("renaming chunk into", t.root(), e)
        })?;
        reservation.settle(&mut ix);
        let now = now_ms();
        ix.insert(id, Entry::new(key.clone(), tier, len, data.len() as u64, now, pin));
        self.metrics.bytes_written.get_or_create(&metrics::tier(tier)).inc_by(data.len() as u64);
        self.update_gauges(&ix);
        Ok(())
    }

    /// Stores into the preferred tier, falling back to the other one when it is full or failing
    /// (e.g. ENOSPC). Returns where the chunk landed, or the last error.
    pub fn store_anywhere(&self, key: &ChunkKey, data: &[u8], prefer: TierKind) -> Result<TierKind, CacheError> {
        // Whoever stores (a warm-up, a mount keeping what it wrote) obeys the policy as reads do.
        if self.resolve(&key.path).no_cache {
            return Err(CacheError::NoCache(key.path.clone()));
        }
        let order = match prefer {
            TierKind::Hot => [TierKind::Hot, TierKind::Warm],
            TierKind::Warm => [TierKind::Warm, TierKind::Hot],
        };
        let mut last = None;
        for t in order.into_iter().filter(|t| self.has(*t)) {
            match self.store(key, data, t) {
                Ok(()) => {
                    if t != prefer
                        && let Some(pin) = self.resolve(&key.path).pin
                    {
                        // Pinned data never evicts other pinned data; say plainly that the pin
                        // is over-committed rather than shuffling silently.
                        warn!(chunk = %key, pinned_to = %pin, kept_in = %t, "pinned set does not fit its tier; chunk kept in {t}");
                    }
                    return Ok(t);
                }
                Err(e) => {
                    debug!(chunk = %key, tier = %t, error = %e, "could not cache chunk in this tier");
                    last = Some(e);
                }
            }
        }
        Err(last.unwrap_or(CacheError::NoSuchTier(prefer)))
    }

    /// Brings a tier under its low watermark if it is above its high one.
    pub fn enforce_watermark(&self, tier: TierKind) -> usize {
        let Ok(t) = self.tier(tier) else { return 0 };
        let how = self.policy().eviction;
        let half_life = self.half_life_ms();
        let victims = {
            let mut ix = self.lock();
            let used = ix.used[tier.index()];
            if used <= t.high_bytes() {
                return 0;
            }
            let v = ix.victims(tier, used - t.low_bytes(), how, half_life);
            for id in &v {
                ix.entries.get_mut(id).expect("victim is present").moving = true;
            }
            v
        };
        for id in &victims {
            self.move_out(tier, id);
        }
        victims.len()
    }

    /// Collects entries matching a predicate and claims them for a move. Yields the id, the tier
    /// and the chunk's data length.
    pub fn claim(&self, pred: impl Fn(&Entry, &Resolved) -> bool) -> Vec<(KeyId, TierKind, u64)> {
        let mut ix = self.lock();
        let mut out = Vec::new();
        for (id, e) in ix.entries.iter_mut() {
            if e.moving {
                continue;
            }
            let r = self.resolve(&e.key.path);
            if pred(e, &r) {
                e.moving = true;
                out.push((*id, e.tier, e.data_len));
            }
        }
        out
    }

    /// Snapshot of access history, persisted so LRU order and idle times survive restarts.
    pub fn access_snapshot(&self) -> HashMap<String, (u64, u64)> {
        let ix = self.lock();
        ix.entries.iter().map(|(id, e)| (id.to_hex(), (e.last_ms, e.hits))).collect()
    }
}
