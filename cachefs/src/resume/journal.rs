//! What a mount's successor needs to go on answering the kernel: every inode number the
//! kernel may hold (with its path and what it shows) and every open read handle (with the
//! version it reads). Kept as an append-only file of JSON lines, written as each number is
//! given out, so that it is whole even when the process is killed: a kernel write is not lost
//! with the process that made it. A successor reads it, and writes it again compacted; so does
//! the process itself once the appends outgrow the last compacted copy (a data loader opening
//! millions of files adds two records per file).

use crate::namespace::Node;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "t")]
pub enum Record {
    /// Inode `ino` is `path`, showing `node`.
    #[serde(rename = "i")]
    Inode { ino: u64, path: String, node: Node },
    /// Handle `fh` reads inode `ino` at `path`, as `node` (its version).
    #[serde(rename = "h")]
    Handle { fh: u64, ino: u64, path: String, node: Node, in_place: bool },
    /// Handle `fh` was released.
    #[serde(rename = "x")]
    Closed { fh: u64 },
}

/// A read handle as the journal has it.
#[derive(Debug, Clone, PartialEq)]
pub struct HandleRecord {
    pub ino: u64,
    pub path: String,
    pub node: Node,
    pub in_place: bool,
}

/// The state a journal describes.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Restored {
    pub inodes: HashMap<u64, (String, Node)>,
    pub handles: HashMap<u64, HandleRecord>,
}

impl Restored {
    fn apply(&mut self, r: Record) {
        match r {
            Record::Inode { ino, path, node } => {
                self.inodes.insert(ino, (path, node));
            }
            Record::Handle { fh, ino, path, node, in_place } => {
                self.handles.insert(fh, HandleRecord { ino, path, node, in_place });
            }
            Record::Closed { fh } => {
                self.handles.remove(&fh);
            }
        }
    }
}

/// Appends past which the journal is compacted: this many bytes, or four times the last
/// compacted size if that is more.
const COMPACT_AFTER: u64 = 64 << 20;

#[derive(Debug)]
pub struct Journal {
    path: PathBuf,
    file: std::sync::Mutex<std::fs::File>,
    /// Bytes appended since the file was last written whole, and when to write it whole again.
    appended: AtomicU64,
    compact_at: AtomicU64,
    /// A write failed: the journal no longer describes the mount, and says so once.
    failed: AtomicBool,
}

impl Journal {
    /// A new, empty journal at `path`.
    pub fn create(path: &Path) -> std::io::Result<Journal> {
        std::fs::write(path, b"")?;
        Self::open(path)
    }

    fn open(path: &Path) -> std::io::Result<Journal> {
        let file = std::fs::OpenOptions::new().append(true).open(path)?;
        let size = file.metadata()?.len();
        Ok(Journal {
            path: path.to_owned(),
            file: std::sync::Mutex::new(file),
            appended: AtomicU64::new(0),
            compact_at: AtomicU64::new(COMPACT_AFTER.max(4 * size)),
            failed: AtomicBool::new(false),
        })
    }

    /// Reads the journal at `path`. A line that does not parse (the last one, cut by a full
    /// disk) is skipped with a warning; what it described is then unknown to the successor,
    /// which answers for it as for a file that is gone.
    pub fn read(path: &Path) -> std::io::Result<Restored> {
        let f = std::io::BufReader::new(std::fs::File::open(path)?);
        let mut state = Restored::default();
        for (n, line) in f.lines().enumerate() {
            let line = line?;
            match serde_json::from_str::<Record>(&line) {
                Ok(r) => state.apply(r),
                Err(e) => {
                    tracing::warn!(journal = %path.display(), line = n + 1, error = %e, "skipping a journal line")
                }
            }
        }
        Ok(state)
    }

    /// Writes `state` as a new journal at `path` (replacing it whole) and opens it to go on.
    pub fn rewrite(path: &Path, state: &Restored) -> std::io::Result<Journal> {
        write_whole(path, state)?;
        Self::open(path)
    }

    /// Whether the appends have outgrown the last compacted copy: time for [`Journal::compact`].
    pub fn wants_compacting(&self) -> bool {
        self.appended.load(Ordering::Relaxed) > self.compact_at.load(Ordering::Relaxed)
    }

    /// Replaces the file with `state`, what the mount holds now. The caller holds what keeps
    /// `state` current (the inode table, the handles) until this returns; appends wait.
    pub fn compact(&self, state: &Restored) {
        let mut file = self.file.lock().unwrap_or_else(|p| p.into_inner());
        let reopened = write_whole(&self.path, state)
            .and_then(|()| std::fs::OpenOptions::new().append(true).open(&self.path))
            .and_then(|f| f.metadata().map(|m| (f, m.len())));
        match reopened {
            Ok((f, size)) => {
                *file = f;
                self.appended.store(0, Ordering::Relaxed);
                self.compact_at.store(COMPACT_AFTER.max(4 * size), Ordering::Relaxed);
            }
            Err(e) => {
                // Appends go on to the old file, which still describes the mount.
                self.appended.store(0, Ordering::Relaxed);
                tracing::warn!(journal = %self.path.display(), error = %e, "cannot compact the mount's journal");
            }
        }
    }
}

fn write_whole(path: &Path, state: &Restored) -> std::io::Result<()> {
    let tmp = path.with_extension("journal.tmp");
    {
        let mut w = std::io::BufWriter::new(std::fs::File::create(&tmp)?);
        for (ino, (p, node)) in &state.inodes {
            let r = Record::Inode { ino: *ino, path: p.clone(), node: node.clone() };
            writeln!(w, "{}", serde_json::to_string(&r).map_err(std::io::Error::other)?)?;
        }
        for (fh, h) in &state.handles {
            let r = Record::Handle {
                fh: *fh,
                ino: h.ino,
                path: h.path.clone(),
                node: h.node.clone(),
                in_place: h.in_place,
            };
            writeln!(w, "{}", serde_json::to_string(&r).map_err(std::io::Error::other)?)?;
        }
        w.flush()?;
    }
    std::fs::rename(&tmp, path)
}

impl Journal {
    /// Appends one record. One write per record, so a record is in the file or not at all.
    pub fn append(&self, r: &Record) {
        let mut line = match serde_json::to_vec(r) {
            Ok(l) => l,
            Err(e) => return self.fail(&e.to_string()),
        };
        line.push(b'\n');
        let file = self.file.lock().unwrap_or_else(|p| p.into_inner());
        match (&*file).write_all(&line) {
            Ok(()) => {
                self.appended.fetch_add(line.len() as u64, Ordering::Relaxed);
            }
            Err(e) => self.fail(&e.to_string()),
        }
    }

    #[cfg(test)]
    fn compact_after(&self, bytes: u64) {
        self.compact_at.store(bytes, Ordering::Relaxed);
    }

    fn fail(&self, error: &str) {
        if !self.failed.swap(true, Ordering::Relaxed) {
            tracing::error!(journal = %self.path.display(), error, "cannot write the mount's journal; a restart of the daemon will not keep this mount's open files");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::namespace::NodeKind;
    use std::time::{Duration, SystemTime};

    fn node(name: &str, version: &str) -> Node {
        Node {
            name: name.into(),
            kind: NodeKind::File,
            size: 7,
            version: version.into(),
            mtime: SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000),
            posix: None,
        }
    }

    #[test]
    fn a_journal_read_back_has_the_last_word_on_each_inode_and_only_open_handles() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.journal");
        let j = Journal::create(&path).unwrap();
        j.append(&Record::Inode { ino: 2, path: "a".into(), node: node("a", "v1") });
        j.append(&Record::Inode { ino: 3, path: "b".into(), node: node("b", "v1") });
        j.append(&Record::Inode { ino: 2, path: "d/a".into(), node: node("a", "v2") });
        j.append(&Record::Handle { fh: 1, ino: 2, path: "d/a".into(), node: node("a", "v2"), in_place: false });
        j.append(&Record::Handle { fh: 2, ino: 3, path: "b".into(), node: node("b", "v1"), in_place: false });
        j.append(&Record::Closed { fh: 2 });
        // A line cut short by a full disk.
        std::fs::OpenOptions::new().append(true).open(&path).unwrap().write_all(b"{\"t\":\"i\",\"ino\":9").unwrap();
        let state = Journal::read(&path).unwrap();
        assert_eq!(state.inodes.len(), 2);
        assert_eq!(state.inodes[&2], ("d/a".to_string(), node("a", "v2")));
        assert_eq!(state.handles.len(), 1);
        assert_eq!(state.handles[&1].node.version, "v2");
        let j = Journal::rewrite(&path, &state).unwrap();
        j.append(&Record::Closed { fh: 1 });
        let again = Journal::read(&path).unwrap();
        assert_eq!(again.inodes, state.inodes);
        assert!(again.handles.is_empty());
    }

    #[test]
    fn a_journal_that_outgrows_its_state_is_compacted_to_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.journal");
        let j = Journal::create(&path).unwrap();
        j.compact_after(4096);
        let mut state = Restored::default();
        state.inodes.insert(2, ("a".into(), node("a", "v1")));
        j.append(&Record::Inode { ino: 2, path: "a".into(), node: node("a", "v1") });
        for fh in 0..100 {
            j.append(&Record::Handle { fh, ino: 2, path: "a".into(), node: node("a", "v1"), in_place: false });
            j.append(&Record::Closed { fh });
        }
        assert!(j.wants_compacting());
        let before = std::fs::metadata(&path).unwrap().len();
        j.compact(&state);
        assert!(!j.wants_compacting());
        assert!(std::fs::metadata(&path).unwrap().len() < before / 10);
        // Appends after the compaction go to the new file.
        j.append(&Record::Handle { fh: 7, ino: 2, path: "a".into(), node: node("a", "v1"), in_place: false });
        let read = Journal::read(&path).unwrap();
        assert_eq!(read.inodes, state.inodes);
        assert_eq!(read.handles.keys().copied().collect::<Vec<_>>(), vec![7]);
    }
}
