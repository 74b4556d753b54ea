//! Handles for reads on a mount that skips opens. On a tree that never changes (an image
//! layer) the kernel is told that opening needs no message: the first open is answered ENOSYS,
//! which FUSE takes as "opens always succeed, send none", and so with flushes. That spares
//! every open and close of a container's thousands of small files a round trip to the daemon,
//! and lets the kernel cache directory listings. Reads then come without a handle; the first
//! read of a file makes one, shared by its readers, and the least recently used go once more
//! than a few are held.

use crate::core::{FsCore, FsError};
use bytes::Bytes;
use std::collections::HashMap;
use std::sync::Mutex;

#[derive(Debug)]
pub struct Implicit {
    cap: usize,
    inner: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    tick: u64,
    /// Inode to (handle, last use).
    by_ino: HashMap<u64, (u64, u64)>,
}

impl Implicit {
    pub fn new(cap: usize) -> Implicit {
        Implicit { cap: cap.max(1), inner: Mutex::new(State::default()) }
    }

    /// The handle for reads of `ino`, made with `open` if there is none yet, and the handle
    /// pushed out to make room for it, if any, for the caller to release.
    pub fn handle(&self, ino: u64, open: impl FnOnce() -> Result<u64, FsError>) -> Result<(u64, Option<u64>), FsError> {
        let mut s = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        s.tick += 1;
        let tick = s.tick;
        if let Some((fh, used)) = s.by_ino.get_mut(&ino) {
            *used = tick;
            return Ok((*fh, None));
        }
        let fh = open()?;
        let evicted = if s.by_ino.len() >= self.cap {
            let oldest = s.by_ino.iter().min_by_key(|(_, (_, used))| *used).map(|(ino, _)| *ino);
            oldest.and_then(|o| s.by_ino.remove(&o)).map(|(fh, _)| fh)
        } else {
            None
        };
        s.by_ino.insert(ino, (fh, tick));
        Ok((fh, evicted))
    }

    /// Reads `ino` through its shared handle. A handle pushed out by reads of many other files
    /// between taking it and reading with it is gone; the second try makes a new one.
    pub async fn read(&self, core: &FsCore, ino: u64, offset: u64, size: u32) -> Result<Bytes, FsError> {
        let mut tries = 0;
        loop {
            tries += 1;
            let (fh, evicted) = self.handle(ino, || core.open(ino, false, false))?;
            if let Some(old) = evicted {
                let _ = core.release(old).await;
            }
            match core.read(fh, offset, size).await {
                Err(FsError::BadHandle) if tries < 2 => self.forget(ino, fh),
                other => return other,
            }
        }
    }

    /// Drops `ino`'s handle if it is still `fh` (which turned out to be released).
    pub fn forget(&self, ino: u64, fh: u64) {
        let mut s = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        if s.by_ino.get(&ino).is_some_and(|(held, _)| *held == fh) {
            s.by_ino.remove(&ino);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_handle_per_file_and_the_least_recently_used_goes() {
        let h = Implicit::new(2);
        let mut next = 10;
        let mut open = || {
            next += 1;
            Ok(next)
        };
        assert_eq!(h.handle(1, &mut open).unwrap(), (11, None));
        assert_eq!(h.handle(2, &mut open).unwrap(), (12, None));
        assert_eq!(h.handle(1, &mut open).unwrap(), (11, None), "a second read reuses the handle");
        assert_eq!(h.handle(3, &mut open).unwrap(), (13, Some(12)), "file 2 was used longest ago");
        assert_eq!(h.handle(2, &mut open).unwrap(), (14, Some(11)));
        assert!(h.handle(4, || Err(FsError::NotFound)).is_err());
        assert_eq!(h.handle(3, &mut open).unwrap(), (13, None), "a failed open changes nothing");
        h.forget(3, 99);
        assert_eq!(h.handle(3, &mut open).unwrap(), (13, None), "only the handle named is forgotten");
        h.forget(3, 13);
        assert_eq!(h.handle(3, &mut open).unwrap(), (15, None), "a forgotten handle is made anew");
    }
}
