//! Which I/O mode each open file of an inode uses, so the kernel accepts it.
//!
//! The kernel puts an inode into one mode at a time: while any open file reads through a backing
//! file (passthrough), an open that uses the page cache fails with ETXTBSY, and the reverse. Only
//! direct-I/O opens may mix with passthrough ones. All passthrough opens of an inode must also
//! share one backing id. This module keeps that bookkeeping, per inode and per handle.
//!
//! It also keeps the page cache to one version of each file. An inode keeps its number when
//! its object is replaced, and the kernel drops an inode's cached pages on its own only when
//! the size changes. So an open of another version than the pages hold starts without them
//! (no `FOPEN_KEEP_CACHE`), and, while handles of the older version are still open and reading
//! through the page cache, reads around it (direct I/O) instead of filling it.

use fuser::BackingId;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

impl Mode {
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Cached => "cached",
            Mode::Passthrough => "passthrough",
            Mode::Direct => "direct",
        }
    }
}

/// How one open file does its I/O.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Through the page cache, served by our read handler.
    Cached,
    /// Through the page cache of the backing file, never reaching us.
    Passthrough,
    /// Straight to our handlers, bypassing every cache; compatible with passthrough opens.
    Direct,
}

#[derive(Debug, Default)]
struct InodeIo {
    /// The shared backing id, the version of the file it holds, and the opens using it.
    backing: Option<(Arc<BackingId>, String, usize)>,
    cached: usize,
    /// Opens an earlier process made, in a mode this one does not know.
    inherited: usize,
}

/// What a new open is told about the inode's page cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PageCache {
    /// The pages the kernel holds are of this open's version: keep them.
    Keep,
    /// Drop them at this open: they are of another version, or of a writer.
    Drop,
}

#[derive(Debug, Default)]
struct Tables {
    inodes: HashMap<u64, InodeIo>,
    /// The version whose bytes each inode's page cache may hold (a hash of it, to keep the
    /// table small for datasets of millions of files); `None` after a writer's open.
    pages: HashMap<u64, Option<u64>>,
    /// Each open handle's inode and mode.
    handles: HashMap<u64, (u64, Mode)>,
    /// Handles an earlier process opened, by inode.
    inherited: HashMap<u64, u64>,
}

#[derive(Debug, Default)]
pub struct IoModes {
    inner: Mutex<Tables>,
}

impl IoModes {
    /// Chooses and records the mode of a new open `fh` of `ino` at `version` (`None`: a writer,
    /// which never passes through). `backing` is asked for a backing id only when passthrough
    /// may start; it runs under the lock, so two first opens cannot register two ids.
    pub fn open(
        &self,
        ino: u64,
        fh: u64,
        version: Option<&str>,
        backing: impl FnOnce() -> Option<BackingId>,
    ) -> (Mode, Option<Arc<BackingId>>, PageCache) {
        let mut g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let wanted = version.map(version_hash);
        let held = g.pages.get(&ino).copied().flatten();
        let io = g.inodes.entry(ino).or_default();
        // The kernel may read an earlier process's open of this inode through a backing file
        // this one did not register, or through the page cache: only direct I/O goes with both.
        if io.inherited > 0 {
            g.handles.insert(fh, (ino, Mode::Direct));
            return (Mode::Direct, None, PageCache::Keep);
        }
        if io.backing.is_none() && io.cached > 0 && wanted.is_some() && held != wanted {
            // Handles of another version read through the page cache: this one goes around it.
            g.handles.insert(fh, (ino, Mode::Direct));
            return (Mode::Direct, None, PageCache::Keep);
        }
        let out = match (&mut io.backing, version) {
            (Some((id, v, n)), Some(version)) if version == v => {
                *n += 1;
                (Mode::Passthrough, Some(id.clone()))
            }
            // A writer, or a newer version than the backing file holds.
            (Some(_), _) => (Mode::Direct, None),
            (None, Some(version)) if io.cached == 0 => match backing() {
                Some(id) => {
                    let id = Arc::new(id);
                    io.backing = Some((id.clone(), version.to_string(), 1));
                    (Mode::Passthrough, Some(id))
                }
                None => {
                    io.cached += 1;
                    (Mode::Cached, None)
                }
            },
            (None, _) => {
                io.cached += 1;
                (Mode::Cached, None)
            }
        };
        g.handles.insert(fh, (ino, out.0));
        let pages = if out.0 == Mode::Cached {
            let keep = wanted.is_some() && held == wanted;
            g.pages.insert(ino, wanted);
            if keep { PageCache::Keep } else { PageCache::Drop }
        } else {
            PageCache::Keep
        };
        (out.0, out.1, pages)
    }

    /// Takes on the open handles `(fh, ino)` an earlier process made, after a takeover.
    pub fn inherit(&self, handles: impl IntoIterator<Item = (u64, u64)>) {
        let mut g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        for (fh, ino) in handles {
            g.inherited.insert(fh, ino);
            g.inodes.entry(ino).or_default().inherited += 1;
        }
    }

    /// Records a close; the backing id is released with the inode's last passthrough open.
    pub fn released(&self, fh: u64) -> Option<Mode> {
        let mut g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(ino) = g.inherited.remove(&fh) {
            if let Some(io) = g.inodes.get_mut(&ino) {
                io.inherited -= 1;
                if io.backing.is_none() && io.cached == 0 && io.inherited == 0 {
                    g.inodes.remove(&ino);
                }
            }
            return Some(Mode::Direct);
        }
        let (ino, mode) = g.handles.remove(&fh)?;
        let Some(io) = g.inodes.get_mut(&ino) else { return Some(mode) };
        match mode {
            Mode::Passthrough => {
                if let Some((_, _, n)) = &mut io.backing {
                    *n -= 1;
                    if *n == 0 {
                        io.backing = None;
                    }
                }
            }
            Mode::Cached => io.cached = io.cached.saturating_sub(1),
            Mode::Direct => {}
        }
        if io.backing.is_none() && io.cached == 0 && io.inherited == 0 {
            g.inodes.remove(&ino);
        }
        Some(mode)
    }
}

fn version_hash(version: &str) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    version.hash(&mut h);
    h.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_inode_an_earlier_process_holds_open_is_read_direct_until_its_handles_close() {
        let modes = IoModes::default();
        modes.inherit([(7, 3), (8, 3)]);
        let (mode, backing, _) = modes.open(3, 20, Some("v1"), || panic!("no backing file may be registered"));
        assert_eq!((mode, backing.is_none()), (Mode::Direct, true));
        // Another inode is not held back.
        assert_eq!(modes.open(4, 21, Some("v1"), || None).0, Mode::Cached);
        assert_eq!(modes.released(7), Some(Mode::Direct));
        assert_eq!(modes.open(3, 22, Some("v1"), || None).0, Mode::Direct, "one inherited handle is still open");
        assert_eq!(modes.released(8), Some(Mode::Direct));
        assert_eq!(modes.released(20), Some(Mode::Direct));
        assert_eq!(modes.released(22), Some(Mode::Direct));
        assert_eq!(modes.open(3, 23, Some("v1"), || None).0, Mode::Cached, "with them closed, as usual");
    }
}
