//! The persistent snapshot metadata: one JSON document, replaced atomically on every change.
//!
//! A node holds hundreds to a few thousand snapshots, so rewriting the whole document (write a
//! temporary file, fsync, rename, fsync the directory) costs little and leaves either the old
//! or the new state after a crash, never a mix.

use crate::error::SnapshotError;
use crate::model::{Kind, Usage};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

/// One snapshot as stored. The id names its directory, and survives Commit's change of name.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Record {
    pub id: u64,
    pub kind: Kind,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent: Option<String>,
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    pub created: SystemTime,
    pub updated: SystemTime,
    /// Measured at Commit; active snapshots are measured when asked.
    #[serde(default)]
    pub usage: Usage,
}

#[derive(Debug, Default, Serialize, Deserialize)]
struct Document {
    version: u32,
    next_id: u64,
    snapshots: BTreeMap<String, Record>,
}

const VERSION: u32 = 1;

/// The metadata of every snapshot, by key, with the file it lives in.
#[derive(Debug)]
pub struct MetaStore {
    path: PathBuf,
    doc: Document,
}

impl MetaStore {
    /// Opens `path`, or starts empty if it does not exist. A damaged file is an error, not a
    /// reset: losing it would orphan every container's rootfs.
    pub fn open(path: &Path) -> Result<MetaStore, SnapshotError> {
        let doc = match std::fs::read(path) {
            Ok(bytes) => {
                let doc: Document = serde_json::from_slice(&bytes)
                    .map_err(|e| SnapshotError::StoreDamaged { path: path.to_owned(), reason: e.to_string() })?;
                if doc.version != VERSION {
                    return Err(SnapshotError::StoreDamaged {
                        path: path.to_owned(),
                        reason: format!("format version {} is not {VERSION}", doc.version),
                    });
                }
                doc
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                Document { version: VERSION, next_id: 1, snapshots: BTreeMap::new() }
            }
            Err(source) => return Err(SnapshotError::Store { path: path.to_owned(), source }),
        };
        Ok(MetaStore { path: path.to_owned(), doc })
    }

    pub fn get(&self, key: &str) -> Option<&Record> {
        self.doc.snapshots.get(key)
    }

    pub fn iter(&self) -> impl Iterator<Item = (&String, &Record)> {
        self.doc.snapshots.iter()
    }

    pub fn has_children(&self, key: &str) -> bool {
        self.doc.snapshots.values().any(|r| r.parent.as_deref() == Some(key))
    }

    /// An id no record or directory uses yet. Ids below `floor` may belong to directories a
    /// crash left behind after they were created but before the metadata named them.
    pub fn allocate_id(&mut self, floor: u64) -> u64 {
        let id = self.doc.next_id.max(floor).max(1);
        self.doc.next_id = id + 1;
        id
    }

    /// Applies `change` to a copy and makes it durable; the in-memory state moves only if the
    /// write succeeded, so a failed save leaves both views as they were.
    pub fn update<T>(
        &mut self,
        change: impl FnOnce(&mut BTreeMap<String, Record>) -> Result<T, SnapshotError>,
    ) -> Result<T, SnapshotError> {
        let mut next = Document { version: VERSION, next_id: self.doc.next_id, snapshots: self.doc.snapshots.clone() };
        let out = change(&mut next.snapshots)?;
        self.save(&next)?;
        self.doc = next;
        Ok(out)
    }

    fn save(&self, doc: &Document) -> Result<(), SnapshotError> {
        let err = |source| SnapshotError::Store { path: self.path.clone(), source };
        let tmp = self.path.with_extension("json.tmp");
        let bytes = serde_json::to_vec_pretty(doc).expect("snapshot metadata serialises");
        let mut f = std::fs::File::create(&tmp).map_err(err)?;
        f.write_all(&bytes).map_err(err)?;
        f.sync_all().map_err(err)?;
        std::fs::rename(&tmp, &self.path).map_err(err)?;
        if let Some(dir) = self.path.parent() {
            std::fs::File::open(dir).and_then(|d| d.sync_all()).map_err(err)?;
        }
        Ok(())
    }
}

pub fn now() -> SystemTime {
    SystemTime::now()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(id: u64) -> Record {
        Record {
            id,
            kind: Kind::Committed,
            parent: None,
            labels: BTreeMap::new(),
            created: now(),
            updated: now(),
            usage: Usage::default(),
        }
    }

    #[test]
    fn survives_reopen_and_keeps_ids_unique() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("metadata.json");
        let mut s = MetaStore::open(&path).unwrap();
        let id = s.allocate_id(0);
        s.update(|m| {
            m.insert("a".into(), record(id));
            Ok(())
        })
        .unwrap();
        let mut s = MetaStore::open(&path).unwrap();
        assert_eq!(s.get("a").unwrap().id, id);
        assert!(s.allocate_id(0) > id, "ids are never reused after a restart");
        assert_eq!(s.allocate_id(50), 50, "ids skip past directories left by a crash");
    }

    #[test]
    fn a_failed_change_leaves_memory_and_disk_as_they_were() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("metadata.json");
        let mut s = MetaStore::open(&path).unwrap();
        let r: Result<(), _> = s.update(|m| {
            m.insert("a".into(), record(1));
            Err(SnapshotError::InvalidArgument("no".into()))
        });
        assert!(r.is_err());
        assert!(s.get("a").is_none());
        assert!(!path.exists());
    }

    #[test]
    fn damaged_metadata_is_an_error_that_names_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("metadata.json");
        std::fs::write(&path, b"{\"version\":1,\"next_id\":").unwrap();
        let e = MetaStore::open(&path).unwrap_err().to_string();
        assert!(e.contains("metadata.json") && e.contains("damaged"), "{e}");
    }
}
