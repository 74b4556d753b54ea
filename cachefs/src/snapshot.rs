//! The namespace snapshot: one recursive listing of a mount's source, persisted, so remounts
//! and the node's other mounts of the same source start from it instead of listing the bucket
//! again. At 128 nodes times a few mounts each, that is the difference between one LIST pass per
//! node per `max_age` and one per mount start.
//!
//! A snapshot file is named by a hash of what it lists. Taking one holds an exclusive lock on a
//! file beside it, so mounts starting together list once: the others wait, then read the fresh
//! file. It is written to a temp file and renamed, so a reader never sees half of one.

use crate::namespace::{Node, NodeKind};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tracing::{info, warn};

#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    #[error("snapshot dir {path}: {source}")]
    Io { path: String, source: std::io::Error },
    #[error("listing for the snapshot failed: {0}")]
    List(String),
}

/// One file of the snapshot: path (relative to the mount), size, version (ETag), mtime in
/// seconds since the epoch.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Entry(pub String, pub u64, pub String, pub i64);

#[derive(Debug, Serialize, Deserialize)]
struct File {
    /// What was listed, to catch a hash collision or a renamed file.
    source: String,
    /// Seconds since the epoch.
    taken: u64,
    entries: Vec<Entry>,
}

fn file_for(dir: &Path, source: &str) -> PathBuf {
    let h = Sha256::digest(source.as_bytes());
    dir.join(format!("{}.json", hex::encode(&h[..12])))
}

fn now_secs() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

/// Reads a snapshot younger than `max_age`, if one is there and sound.
fn read_fresh(path: &Path, source: &str, max_age: Duration) -> Option<Vec<Entry>> {
    let bytes = match std::fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return None,
        Err(e) => {
            warn!(path = %path.display(), error = %e, "namespace snapshot unreadable; listing the source");
            return None;
        }
    };
    let f: File = match serde_json::from_slice(&bytes) {
        Ok(f) => f,
        Err(e) => {
            warn!(path = %path.display(), error = %e, "namespace snapshot unreadable; listing the source");
            return None;
        }
    };
    let age = now_secs().saturating_sub(f.taken);
    (f.source == source && age < max_age.as_secs().max(1) && !max_age.is_zero()).then_some(f.entries)
}

/// The snapshot of `source` in `dir`: the stored one if younger than `max_age`, else a new one
/// from `list` (which it stores for the next mount, as taken when the listing was made: `list`
/// gives its age, non-zero when a peer listed for the cluster). Returns the entries and whether
/// they came from a listing just now.
pub async fn load_or_take<F, Fut>(
    dir: &Path,
    source: &str,
    max_age: Duration,
    list: F,
) -> Result<(Vec<Entry>, bool), SnapshotError>
where
    F: FnOnce() -> Fut,
    Fut: Future<Output = Result<(Vec<Entry>, Duration), String>>,
{
    let io = |source| SnapshotError::Io { path: dir.display().to_string(), source };
    std::fs::create_dir_all(dir).map_err(io)?;
    let path = file_for(dir, source);
    if let Some(entries) = read_fresh(&path, source, max_age) {
        return Ok((entries, false));
    }
    let lock_path = path.with_extension("lock");
    let lock = std::fs::OpenOptions::new().create(true).truncate(false).write(true).open(&lock_path).map_err(io)?;
    let lock = tokio::task::spawn_blocking(move || lock.lock().map(|_| lock))
        .await
        .map_err(|e| SnapshotError::List(e.to_string()))?
        .map_err(io)?;
    // Another mount may have taken it while this one waited for the lock.
    if let Some(entries) = read_fresh(&path, source, max_age) {
        return Ok((entries, false));
    }
    let (entries, age) = list().await.map_err(SnapshotError::List)?;
    let taken = now_secs().saturating_sub(age.as_secs());
    let body = serde_json::to_vec(&File { source: source.to_string(), taken, entries: entries.clone() })
        .map_err(|e| SnapshotError::List(e.to_string()))?;
    let tmp = path.with_extension(format!("tmp.{}", std::process::id()));
    std::fs::write(&tmp, body).and_then(|_| std::fs::rename(&tmp, &path)).map_err(io)?;
    drop(lock);
    info!(source, objects = entries.len(), path = %path.display(), "namespace snapshot taken");
    Ok((entries, true))
}

/// The directory tree of a snapshot: every directory ("" for the root) with its children.
pub fn tree(entries: &[Entry]) -> std::collections::HashMap<String, Vec<Node>> {
    use std::collections::{HashMap, HashSet};
    let mut dirs: HashMap<String, Vec<Node>> = HashMap::new();
    let mut seen_dirs: HashSet<String> = HashSet::new();
    dirs.insert(String::new(), Vec::new());
    for Entry(path, size, version, mtime) in entries {
        let path = path.trim_matches('/');
        let Some(name) = path.rsplit('/').next().filter(|n| !n.is_empty()) else { continue };
        let parent = path.rsplit_once('/').map(|(d, _)| d).unwrap_or("");
        let mtime = UNIX_EPOCH + Duration::from_secs((*mtime).max(0) as u64);
        dirs.entry(parent.to_string()).or_default().push(Node {
            name: name.to_string(),
            kind: NodeKind::File,
            size: *size,
            version: version.clone(),
            mtime,
            posix: None,
        });
        // Every ancestor is a directory of its own parent.
        let mut d = parent;
        while !d.is_empty() && seen_dirs.insert(d.to_string()) {
            let (up, dname) = d.rsplit_once('/').unwrap_or(("", d));
            dirs.entry(d.to_string()).or_default();
            dirs.entry(up.to_string()).or_default().push(Node {
                name: dname.to_string(),
                kind: NodeKind::Dir,
                size: 0,
                version: String::new(),
                mtime: UNIX_EPOCH,
                posix: None,
            });
            d = up;
        }
    }
    dirs
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tree_has_every_ancestor_once() {
        let e = |p: &str| Entry(p.into(), 1, "e".into(), 0);
        let t = tree(&[e("a/b/c"), e("a/b/d"), e("a/x"), e("top")]);
        let names = |d: &str| {
            let mut v: Vec<_> = t[d].iter().map(|n| n.name.clone()).collect();
            v.sort();
            v
        };
        assert_eq!(names(""), ["a", "top"]);
        assert_eq!(names("a"), ["b", "x"]);
        assert_eq!(names("a/b"), ["c", "d"]);
        assert_eq!(t["a"].iter().find(|n| n.name == "b").unwrap().kind, NodeKind::Dir);
    }

    #[tokio::test]
    async fn a_fresh_snapshot_is_reused_and_a_corrupt_one_is_retaken() {
        let dir = tempfile::tempdir().unwrap();
        let one = || async { Ok((vec![Entry("f".into(), 1, "e1".into(), 0)], Duration::ZERO)) };
        let two = || async { Ok((vec![Entry("g".into(), 2, "e2".into(), 0)], Duration::ZERO)) };
        let hour = Duration::from_secs(3600);
        assert!(load_or_take(dir.path(), "s", hour, one).await.unwrap().1);
        let (entries, listed) = load_or_take(dir.path(), "s", hour, two).await.unwrap();
        assert!(!listed);
        assert_eq!(entries[0].0, "f", "the stored snapshot is used, not a new listing");
        // Another source never reads this one's snapshot.
        assert_eq!(load_or_take(dir.path(), "other", hour, two).await.unwrap().0[0].0, "g");
        // max_age 0 always lists; a corrupt file is replaced by a new listing.
        assert!(load_or_take(dir.path(), "s", Duration::ZERO, two).await.unwrap().1);
        std::fs::write(file_for(dir.path(), "s"), b"{not json").unwrap();
        let (entries, listed) = load_or_take(dir.path(), "s", hour, one).await.unwrap();
        assert!(listed);
        assert_eq!(entries[0].0, "f");
        // A listing a peer made 50 minutes ago is stored as taken then: ten minutes later it
        // is past the hour, and the next mount lists again.
        let old = || async { Ok((vec![Entry("h".into(), 3, "e3".into(), 0)], Duration::from_secs(3000))) };
        assert_eq!(load_or_take(dir.path(), "aged", hour, old).await.unwrap().0[0].0, "h");
        let ten_minutes = Duration::from_secs(600);
        assert!(load_or_take(dir.path(), "aged", ten_minutes, two).await.unwrap().1, "the aged snapshot is not reused");
    }
}
