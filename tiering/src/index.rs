//! The in-memory index of cached chunks: where each chunk lives, its size, its access history,
//! and per-tier accounting of used and reserved bytes.

use crate::key::{ChunkKey, Identity, KeyId};
use crate::policy::Eviction;
use crate::tier::TierKind;
use std::collections::HashMap;
use std::time::{SystemTime, UNIX_EPOCH};

pub(crate) fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

#[derive(Debug, Clone)]
pub(crate) struct Entry {
    pub key: ChunkKey,
    pub tier: TierKind,
    /// Bytes on disk, header included: what counts against the tier's capacity.
    pub disk_len: u64,
    pub data_len: u64,
    pub inserted_ms: u64,
    pub last_ms: u64,
    pub hits: u64,
    /// LRFU combined recency and frequency, as of `last_ms`.
    pub crf: f64,
    pub pin: Option<TierKind>,
    /// A demotion, promotion or eviction has claimed this entry.
    pub moving: bool,
    /// Changes whenever the entry's file changes, so a mover can tell its snapshot is stale.
    pub generation: u64,
}

impl Entry {
    /// A new entry, accessed once at `at_ms`.
    pub fn new(key: ChunkKey, tier: TierKind, disk_len: u64, data_len: u64, at_ms: u64, pin: Option<TierKind>) -> Self {
        Entry {
            key,
            tier,
            disk_len,
            data_len,
            inserted_ms: at_ms,
            last_ms: at_ms,
            hits: 1,
            crf: 1.0,
            pin,
            moving: false,
            generation: 0,
        }
    }

    pub fn touch(&mut self, now: u64, half_life_ms: f64) {
        self.crf = 1.0 + self.crf_at(now, half_life_ms);
        self.last_ms = now.max(self.last_ms);
        self.hits += 1;
    }

    fn crf_at(&self, now: u64, half_life_ms: f64) -> f64 {
        let age = now.saturating_sub(self.last_ms) as f64;
        self.crf * 0.5f64.powf(age / half_life_ms.max(1.0))
    }

    /// Lower scores leave first.
    fn score(&self, how: Eviction, now: u64, half_life_ms: f64) -> (f64, u64) {
        match how {
            Eviction::Lru => (self.last_ms as f64, 0),
            Eviction::Lfu => (self.hits as f64, self.last_ms),
            Eviction::Lrfu => (self.crf_at(now, half_life_ms), self.last_ms),
        }
    }
}

#[derive(Debug, Default)]
pub(crate) struct Index {
    pub entries: HashMap<KeyId, Entry>,
    pub used: [u64; 2],
    pub reserved: [u64; 2],
    pub chunks: [u64; 2],
    next_generation: u64,
    /// The versions, by path, that have a whole-file copy: their chunks repeat its bytes.
    copies: HashMap<String, Vec<String>>,
}

impl Index {
    pub fn next_generation(&mut self) -> u64 {
        self.next_generation += 1;
        self.next_generation
    }

    pub fn insert(&mut self, id: KeyId, mut e: Entry) {
        e.generation = self.next_generation();
        self.used[e.tier.index()] += e.disk_len;
        self.chunks[e.tier.index()] += 1;
        if let Identity::File { version, .. } = &e.key.identity {
            self.copies.entry(e.key.path.clone()).or_default().push(version.clone());
        }
        if let Some(old) = self.entries.insert(id, e) {
            self.account_removed(&old);
        }
    }

    pub fn remove(&mut self, id: &KeyId) -> Option<Entry> {
        let e = self.entries.remove(id)?;
        self.account_removed(&e);
        Some(e)
    }

    fn account_removed(&mut self, e: &Entry) {
        let t = e.tier.index();
        self.used[t] -= e.disk_len;
        self.chunks[t] -= 1;
        if let Identity::File { version, .. } = &e.key.identity
            && let Some(versions) = self.copies.get_mut(&e.key.path)
        {
            if let Some(i) = versions.iter().position(|v| v == version) {
                versions.swap_remove(i);
            }
            if versions.is_empty() {
                self.copies.remove(&e.key.path);
            }
        }
    }

    /// Whether `e` is a chunk of an object version whose whole-file copy is indexed: every
    /// open of that version is then served from the copy, so the chunk is the cheapest entry to
    /// move down a tier.
    fn repeated_by_a_copy(&self, e: &Entry) -> bool {
        let Identity::Object { version, .. } = &e.key.identity else { return false };
        self.copies.get(&e.key.path).is_some_and(|vs| vs.contains(version))
    }

    /// Moves the accounting of an entry to another tier after its file moved.
    pub fn relocate(&mut self, id: &KeyId, to: TierKind, disk_len: u64) {
        let generation = self.next_generation();
        let e = self.entries.get_mut(id).expect("relocate of a present entry");
        let from = e.tier.index();
        self.used[from] -= e.disk_len;
        self.chunks[from] -= 1;
        e.tier = to;
        e.disk_len = disk_len;
        e.moving = false;
        e.generation = generation;
        self.used[to.index()] += disk_len;
        self.chunks[to.index()] += 1;
    }

    /// Bytes in `tier` that no eviction may take: chunks pinned to any tier. A chunk pinned to
    /// the other tier sits here only while that tier has no room for it.
    pub fn pinned_bytes(&self, tier: TierKind) -> u64 {
        self.entries.values().filter(|e| e.tier == tier && e.pin.is_some()).map(|e| e.disk_len).sum()
    }

    /// Picks entries of `tier` to move out until at least `need` bytes are freed, in the order
    /// the eviction policy gives. Pinned entries (for warm: pinned anywhere) are never picked.
    ///
    /// In the hot tier, chunks that a whole-file copy repeats go first, whatever their score:
    /// a fully read file is held twice there, and taking its copy (which is dropped, not
    /// demoted) instead would lose the kernel's direct reads of it while the chunks it repeats
    /// stayed. The chunks go down to warm (or out, without one); read again, they come back
    /// up, and a copy can be made from them again.
    pub fn victims(&self, tier: TierKind, need: u64, how: Eviction, half_life_ms: f64) -> Vec<KeyId> {
        let now = now_ms();
        let mut c: Vec<(&KeyId, (bool, f64, u64), u64)> = self
            .entries
            .iter()
            .filter(|(_, e)| e.tier == tier && !e.moving && e.pin.is_none_or(|p| tier == TierKind::Hot && p != tier))
            .map(|(id, e)| {
                let (score, tie) = e.score(how, now, half_life_ms);
                let repeated = tier == TierKind::Hot && self.repeated_by_a_copy(e);
                (id, (!repeated, score, tie), e.disk_len)
            })
            .collect();
        c.sort_by(|a, b| a.1.partial_cmp(&b.1).unwrap_or(std::cmp::Ordering::Equal));
        let mut freed = 0;
        let mut out = Vec::new();
        for (id, _, len) in c {
            if freed >= need {
                break;
            }
            freed += len;
            out.push(*id);
        }
        out
    }
}
