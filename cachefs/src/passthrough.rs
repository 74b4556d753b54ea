//! Which I/O mode each open file of an inode uses, so the kernel accepts it.
//!
//! The kernel puts an inode into one mode at a time: while any open file reads through a backing
//! file (passthrough), an open that uses the page cache fails with ETXTBSY, and the reverse. Only
//! direct-I/O opens may mix with passthrough ones. All passthrough opens of an inode must also
//! share one backing id. This module keeps that bookkeeping, per inode and per handle.

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
}

#[derive(Debug, Default)]
struct Tables {
    inodes: HashMap<u64, InodeIo>,
    /// Each open handle's inode and mode.
    handles: HashMap<u64, (u64, Mode)>,
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
    ) -> (Mode, Option<Arc<BackingId>>) {
        let mut g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let io = g.inodes.entry(ino).or_default();
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
        out
    }

    /// Records a close; the backing id is released with the inode's last passthrough open.
    pub fn released(&self, fh: u64) -> Option<Mode> {
        let mut g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
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
        if io.backing.is_none() && io.cached == 0 {
            g.inodes.remove(&ino);
        }
        Some(mode)
    }
}
