//! Renaming a directory. An object store has no directories, so every object under the old
//! prefix is copied to the new one, and only then are the old ones deleted. A journal in the
//! staging dir, written before the first copy, lets the next start finish a rename that a crash
//! cut short, so the tree never stays split between the two names.

use super::{FsCore, FsError, Inode, Renaming, join};
use crate::namespace::{Node, NodeKind, NsError};
use futures::StreamExt;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// Copies and deletes in flight.
const PARALLEL: usize = 16;

/// Journal files are `rename-<nanos>.journal`, apart from the staged files' numbered names.
const JOURNAL_PREFIX: &str = "rename-";
const JOURNAL_SUFFIX: &str = ".journal";

/// A directory rename under way: what the next start finishes if this run does not.
#[derive(Debug, Serialize, Deserialize)]
struct Journal {
    from: String,
    to: String,
}

/// The rename journal in `bytes`, as a restart reads it: both names are object paths of the
/// mount, and neither is inside the other, as for any rename a mount makes. A damaged journal
/// must not have a restart copy or delete a tree it never named.
pub fn read_journal(bytes: &[u8]) -> Result<(String, String), String> {
    let j: Journal = serde_json::from_slice(bytes).map_err(|e| e.to_string())?;
    for p in [&j.from, &j.to] {
        if !crate::staging::is_relative_object_path(p) {
            return Err(format!("{p:?} is not an object path of the mount"));
        }
    }
    if moved(&j.to, &j.from, "x").is_some() || moved(&j.from, &j.to, "x").is_some() {
        return Err(format!("{:?} and {:?} are one inside the other", j.from, j.to));
    }
    Ok((j.from, j.to))
}

/// Where `path` goes when the directory `from` becomes `to`, if it is under `from`.
fn moved(path: &str, from: &str, to: &str) -> Option<String> {
    if path == from {
        return Some(to.to_string());
    }
    path.strip_prefix(from).and_then(|rest| rest.strip_prefix('/')).map(|rest| format!("{to}/{rest}"))
}

fn write_journal(dir: &Path, j: &Journal) -> std::io::Result<PathBuf> {
    use std::io::Write;
    std::fs::create_dir_all(dir)?;
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_nanos();
    let path = dir.join(format!("{JOURNAL_PREFIX}{nanos}{JOURNAL_SUFFIX}"));
    let mut f = std::fs::File::create(&path)?;
    f.write_all(&serde_json::to_vec(j).map_err(std::io::Error::other)?)?;
    f.sync_all()?;
    std::fs::File::open(dir)?.sync_all()?;
    Ok(path)
}

impl FsCore {
    /// Renames the directory `src` (at `from`) to `new_name` in `new_parent`. An empty
    /// directory there is replaced; a non-empty one is `ENOTEMPTY`, as on a local file system.
    /// Files still being written inside go up under their new names.
    pub(super) async fn rename_dir(
        &self,
        parent: u64,
        name: &str,
        src: u64,
        new_parent: u64,
        new_name: &str,
    ) -> Result<(), FsError> {
        let staging = self.opts.staging_dir.clone().ok_or(FsError::NotSupported("this mount is read-only"))?;
        let from = self.inode(src)?.path;
        let dst_dir = self.inode(new_parent)?;
        if dst_dir.node.kind != NodeKind::Dir {
            return Err(FsError::NotDir);
        }
        let to = join(&dst_dir.path, new_name);
        if to == from {
            return Ok(());
        }
        if to.starts_with(&format!("{from}/")) {
            return Err(FsError::Invalid("a directory cannot be moved into itself"));
        }
        match self.lookup(new_parent, new_name).await {
            Ok(existing) if existing.kind != NodeKind::Dir => return Err(FsError::NotDir),
            Ok(existing) => {
                self.forget_listing(existing.ino);
                if !self.listing(existing.ino).await?.is_empty() {
                    return Err(FsError::NotEmpty);
                }
            }
            Err(FsError::NotFound) => {}
            Err(e) => return Err(e),
        }

        // Everything under the directory counts as being renamed, so a closed file's bytes go
        // into the cache under its new name once this is done, and no writer inside publishes
        // under the old name meanwhile.
        let inside: Vec<(String, u64)> = {
            let t = self.inodes.read().unwrap_or_else(|p| p.into_inner());
            t.by_path.iter().filter(|(p, _)| moved(p, &from, &to).is_some()).map(|(p, i)| (p.clone(), *i)).collect()
        };
        let _renaming: Vec<Renaming<'_>> =
            inside.iter().map(|(_, ino)| Renaming::start(&self.renaming, *ino)).collect();
        let mut writers: Vec<(u64, std::sync::Arc<tokio::sync::Mutex<crate::staging::Staged>>)> =
            inside.iter().filter_map(|(_, ino)| self.staged_of(*ino).map(|s| (*ino, s))).collect();
        writers.sort_by_key(|(ino, _)| *ino);
        // Older copies of a file inside, still going up from their releases, land before the
        // tree is copied, and so are copied with it: after the copy, they would bring the old
        // name back. The newest copy of each is held below instead; a file with none has no
        // older ones either.
        for (ino, newest) in &writers {
            self.wait_uploads(*ino, Some(newest)).await;
        }
        let mut held = Vec::with_capacity(writers.len());
        for (_, s) in &writers {
            held.push(s.clone().lock_owned().await);
        }

        let journal = write_journal(&staging, &Journal { from: from.clone(), to: to.clone() })
            .map_err(|source| FsError::Stage { path: from.clone(), source })?;
        let files = match self.copy_tree(&from, &to).await {
            Ok(files) => files,
            Err(e) => {
                // Nothing of the source is gone: the rename did not happen. Copies already made
                // go, so the new name does not show a part of the tree.
                let (err, made) = e;
                self.remove_all(made.into_iter()).await;
                let _ = std::fs::remove_file(&journal);
                return Err(err);
            }
        };
        for s in held.iter_mut() {
            if let Some(target) = moved(&s.target, &from, &to) {
                s.retarget(&target).map_err(|source| FsError::Stage { path: target.clone(), source })?;
            }
        }
        drop(held);
        let failed = self.remove_all(files.keys().cloned()).await;
        if let Some((path, source)) = failed {
            // The new name holds everything; the journal stays, so the next start deletes the
            // rest of the old name.
            self.forget_tree();
            return Err(FsError::Namespace { what: "deleting the renamed", path, source });
        }
        let _ = std::fs::remove_file(&journal);
        self.cache.metrics().fs_dir_rename_objects.inc_by(files.len() as u64);

        let rekey = self.move_inodes(src, &from, &to, new_name, &files);
        self.forget_tree();
        self.forget_listing(parent);
        self.forget_listing(new_parent);
        self.forget_name(parent, name);
        self.forget_name(new_parent, new_name);
        let keeper = self.keeper.clone();
        tokio::spawn(async move {
            for (old_path, old, new_path, new) in rekey {
                keeper.rekey_cached(&old_path, &old, &new_path, &new).await;
            }
        });
        tracing::info!(from = %from, to = %to, files = files.len(), "directory renamed");
        Ok(())
    }

    /// Copies every object under `from` to the same place under `to`. Returns the new nodes by
    /// old path; on failure, the error and the paths of the copies already made.
    async fn copy_tree(&self, from: &str, to: &str) -> Result<HashMap<String, Node>, (FsError, Vec<String>)> {
        let files = self
            .ns
            .list_tree(from)
            .await
            .map_err(|source| (FsError::List { dir: from.to_string(), source }, Vec::new()))?;
        let mut copies = futures::stream::iter(files.into_iter().filter_map(|(old, listed)| {
            let new = moved(&old, from, to)?;
            let copy = self.ns.copy(&old, &listed, &new);
            Some(async move { (old, new, copy.await) })
        }))
        .buffer_unordered(PARALLEL);
        let (mut done, mut made, mut failed) = (HashMap::new(), Vec::new(), None);
        while let Some((old, new, r)) = copies.next().await {
            match r {
                Ok(node) => {
                    made.push(new);
                    done.insert(old, node);
                }
                Err(source) if failed.is_none() => {
                    failed = Some(FsError::Namespace { what: "copying the renamed", path: old, source })
                }
                Err(_) => {}
            }
        }
        match failed {
            Some(e) => Err((e, made)),
            None => Ok(done),
        }
    }

    /// Deletes `paths`, in bulk where the store can; an object already gone counts as
    /// deleted. Returns the first failure.
    async fn remove_all(&self, paths: impl Iterator<Item = String>) -> Option<(String, NsError)> {
        self.ns.remove_all(paths.collect()).await.err()
    }

    /// Gives every inode under `from` its path under `to`, keeping its number, as a local file
    /// system keeps a moved file's inode. Returns the files whose cached chunks should follow.
    fn move_inodes(
        &self,
        src: u64,
        from: &str,
        to: &str,
        new_name: &str,
        copied: &HashMap<String, Node>,
    ) -> Vec<(String, Node, String, Node)> {
        let mut rekey = Vec::new();
        let mut t = self.changing(&[from, to]);
        let inside: Vec<(String, u64)> =
            t.by_path.iter().filter(|(p, _)| moved(p, from, to).is_some()).map(|(p, i)| (p.clone(), *i)).collect();
        // Every directory inside changes its path: answers about any of them, old or new, may
        // be from before the move.
        let touched: Vec<String> =
            inside.iter().flat_map(|(p, _)| [p.clone(), moved(p, from, to).unwrap_or_default()]).collect();
        t.touch(&touched.iter().map(String::as_str).collect::<Vec<_>>());
        // The moved directories themselves too: a listing of one may be on its way.
        let dirs: Vec<String> = inside
            .iter()
            .filter(|(_, ino)| t.by_ino.get(ino).is_some_and(|i| i.node.kind == crate::namespace::NodeKind::Dir))
            .flat_map(|(p, _)| [p.clone(), moved(p, from, to).unwrap_or_default()])
            .collect();
        let at = (t.changes, std::time::Instant::now());
        for d in dirs {
            t.changed.insert(d, at);
        }
        // Whatever the new names showed before (an empty directory) is replaced.
        let replaced: Vec<u64> =
            t.by_path.iter().filter(|(p, _)| moved(p, to, to).is_some()).map(|(_, i)| *i).collect();
        for ino in replaced {
            if !inside.iter().any(|(_, i)| *i == ino) {
                t.by_ino.remove(&ino);
            }
        }
        t.by_path.retain(|p, _| moved(p, to, to).is_none());
        for (old_path, _) in &inside {
            t.by_path.remove(old_path);
        }
        for (old_path, ino) in inside {
            let Some(new_path) = moved(&old_path, from, to) else { continue };
            let Some(old) = t.by_ino.get(&ino).map(|i| i.node.clone()) else { continue };
            let mut node = match copied.get(&old_path) {
                Some(n) => {
                    let mut n = n.clone();
                    n.name = old.name.clone();
                    rekey.push((old_path.clone(), old.clone(), new_path.clone(), n.clone()));
                    n
                }
                None => old,
            };
            if ino == src {
                node.name = new_name.to_string();
            }
            t.by_path.insert(new_path.clone(), ino);
            t.put(ino, Inode { path: new_path, node });
        }
        drop(t);
        let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        let moving: Vec<String> = pending.keys().filter(|p| moved(p, from, to).is_some()).cloned().collect();
        pending.retain(|p, _| moved(p, to, to).is_none());
        for old in moving {
            if let (Some(mut node), Some(new)) = (pending.remove(&old), moved(&old, from, to)) {
                if old == from {
                    node.name = new_name.to_string();
                }
                pending.insert(new, node);
            }
        }
        rekey
    }

    /// Forgets every listing and looked-up name, after a change to a whole subtree: the next
    /// lookups and listings ask the store again.
    fn forget_tree(&self) {
        self.listings.lock().unwrap_or_else(|p| p.into_inner()).clear();
        self.entries.invalidate_all();
        self.negative.invalidate_all();
    }

    /// Finishes directory renames that a crash cut short: what is still under the old name is
    /// copied to the new one and then deleted there. Returns one line per rename for the
    /// operator, which the caller logs.
    pub async fn recover_renames(&self) -> Vec<String> {
        let Some(dir) = &self.opts.staging_dir else { return Vec::new() };
        let Ok(rd) = std::fs::read_dir(dir) else { return Vec::new() };
        let mut journals: Vec<PathBuf> = rd
            .filter_map(|e| e.ok())
            .map(|e| e.path())
            .filter(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with(JOURNAL_PREFIX) && n.ends_with(JOURNAL_SUFFIX))
            })
            .collect();
        journals.sort();
        let mut report = Vec::new();
        for path in journals {
            let j = match std::fs::read(&path).map_err(|e| e.to_string()).and_then(|b| read_journal(&b)) {
                Ok((from, to)) => Journal { from, to },
                Err(e) => {
                    let line = format!("{}: unreadable rename journal ({e}); kept", path.display());
                    report.push(line);
                    continue;
                }
            };
            let line = match self.copy_tree(&j.from, &j.to).await {
                Err((e, _)) => format!(
                    "{} -> {}: finishing a rename cut short by a crash failed: {e}; retried at the next start",
                    j.from, j.to
                ),
                Ok(files) => match self.remove_all(files.keys().cloned()).await {
                    Some((p, e)) => format!(
                        "{} -> {}: finishing a rename cut short by a crash failed deleting {p}: {e}; retried at the next start",
                        j.from, j.to
                    ),
                    None => {
                        let _ = std::fs::remove_file(&path);
                        self.cache.metrics().fs_renames_finished_at_start.inc();
                        self.cache.metrics().fs_dir_rename_objects.inc_by(files.len() as u64);
                        format!(
                            "{} -> {}: a rename cut short by a crash was finished ({} objects moved)",
                            j.from,
                            j.to,
                            files.len()
                        )
                    }
                },
            };
            report.push(line);
        }
        report
    }
}

#[cfg(test)]
mod tests {
    use super::super::ROOT;
    use super::super::tests_support::{cold, setup};
    use super::*;

    async fn write(fs: &FsCore, parent: u64, name: &str, data: &[u8]) -> u64 {
        let (a, fh) = fs.create(parent, name).await.unwrap();
        fs.write(fh, 0, data).await.unwrap();
        fs.release(fh).await.unwrap();
        a.ino
    }

    #[test]
    fn paths_move_only_from_inside_the_directory() {
        for (from, to, why) in [
            ("a", "a/b", "one inside the other"),
            ("a/b", "a", "one inside the other"),
            ("a", "a", "one inside the other"),
            ("", "b", "not an object path"),
            ("a", "../b", "not an object path"),
        ] {
            let e = read_journal(format!(r#"{{"from":{from:?},"to":{to:?}}}"#).as_bytes()).unwrap_err();
            assert!(e.contains(why), "{from:?} -> {to:?}: {e}");
        }
        assert_eq!(read_journal(br#"{"from":"ck.tmp","to":"ck"}"#).unwrap(), ("ck.tmp".into(), "ck".into()));
        assert_eq!(moved("a/b", "a/b", "c").as_deref(), Some("c"));
        assert_eq!(moved("a/b/x/y", "a/b", "c/d").as_deref(), Some("c/d/x/y"));
        assert_eq!(moved("a/bc", "a/b", "c"), None);
        assert_eq!(moved("a", "a/b", "c"), None);
    }

    #[tokio::test]
    async fn a_checkpoint_directory_renamed_into_place_moves_every_file() {
        let dir = tempfile::tempdir().unwrap();
        let fs = setup(dir.path());
        let tmp = fs.mkdir(ROOT, "step.tmp-0").await.unwrap();
        let sub = fs.mkdir(tmp.ino, "state").await.unwrap();
        let x = write(&fs, tmp.ino, "meta", b"m").await;
        write(&fs, sub.ino, "shard0", &[7u8; 10_000]).await;
        let empty = fs.mkdir(tmp.ino, "empty").await.unwrap();
        fs.rename(ROOT, "step.tmp-0", ROOT, "step").await.unwrap();

        assert_eq!(cold(dir.path(), "step/meta").unwrap(), b"m");
        assert_eq!(cold(dir.path(), "step/state/shard0").unwrap(), vec![7u8; 10_000]);
        assert!(!dir.path().join("cold/step.tmp-0").exists(), "nothing is left under the old name");
        assert!(matches!(fs.lookup(ROOT, "step.tmp-0").await, Err(FsError::NotFound)));
        let step = fs.lookup(ROOT, "step").await.unwrap();
        assert_eq!(step.ino, tmp.ino, "the directory keeps its inode");
        let meta = fs.lookup(step.ino, "meta").await.unwrap();
        assert_eq!(meta.ino, x);
        let fh = fs.open(meta.ino, false, false).unwrap();
        assert_eq!(fs.read(fh, 0, 10).await.unwrap(), &b"m"[..]);
        fs.release(fh).await.unwrap();
        assert_eq!(fs.lookup(step.ino, "empty").await.unwrap().ino, empty.ino, "an empty new directory moves too");
        let names: Vec<String> = fs.readdir(step.ino).await.unwrap().into_iter().map(|(_, _, n)| n).collect();
        assert!(names.contains(&"state".to_string()) && names.contains(&"meta".to_string()), "{names:?}");
        assert!(
            std::fs::read_dir(dir.path().join("staging")).unwrap().all(|e| !e
                .unwrap()
                .path()
                .to_string_lossy()
                .ends_with(JOURNAL_SUFFIX)),
            "the journal goes once the rename is done"
        );
    }

    #[tokio::test]
    async fn a_renamed_checkpoint_directory_stays_hot_under_its_new_name() {
        let dir = tempfile::tempdir().unwrap();
        let fs = setup(dir.path());
        let tmp = fs.mkdir(ROOT, "ck.tmp").await.unwrap();
        let shard: Vec<u8> = (0..10_000u32).map(|i| (i % 241) as u8).collect();
        // The release caches the staged bytes under the name the file has then.
        write(&fs, tmp.ino, "shard", &shard).await;
        fs.rename(ROOT, "ck.tmp", ROOT, "ck").await.unwrap();
        let ck = fs.lookup(ROOT, "ck").await.unwrap();
        let f = fs.lookup(ck.ino, "shard").await.unwrap();
        let i = fs.inode(f.ino).unwrap();
        let keys: Vec<_> = (0..3).map(|n| fs.ns.chunk_key(&i.path, &i.node, n)).collect();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while keys.iter().any(|k| fs.cache.get_local_blocking(k).is_none()) && std::time::Instant::now() < deadline {
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        let cached: Vec<u8> = keys.iter().flat_map(|k| fs.cache.get_local_blocking(k).unwrap().to_vec()).collect();
        assert_eq!(cached, shard, "the chunks are hot under the new name");
        assert!(
            fs.cache.pins().iter().any(|p| p.pattern.to_string().contains("ck/shard")),
            "the moved checkpoint is its directory's newest: {:?}",
            fs.cache.pins()
        );
    }

    #[tokio::test]
    async fn a_directory_is_renamed_over_an_empty_one_but_not_a_full_one_nor_into_itself() {
        let dir = tempfile::tempdir().unwrap();
        let fs = setup(dir.path());
        let a = fs.mkdir(ROOT, "a").await.unwrap();
        write(&fs, a.ino, "f", b"1").await;
        fs.mkdir(ROOT, "empty").await.unwrap();
        // `d` holds big.bin and e/small.
        assert!(matches!(fs.rename(ROOT, "a", ROOT, "d").await, Err(FsError::NotEmpty)));
        assert!(matches!(fs.rename(ROOT, "a", a.ino, "inner").await, Err(FsError::Invalid(_))));
        let d = fs.lookup(ROOT, "d").await.unwrap();
        assert!(matches!(fs.rename(ROOT, "a", d.ino, "big.bin").await, Err(FsError::NotDir)));
        assert_eq!(cold(dir.path(), "a/f").unwrap(), b"1", "a refused rename moves nothing");
        fs.rename(ROOT, "a", ROOT, "empty").await.unwrap();
        assert_eq!(cold(dir.path(), "empty/f").unwrap(), b"1");
        assert!(cold(dir.path(), "a/f").is_none());
        // A directory of the store, not one this mount made.
        fs.rename(ROOT, "d", ROOT, "moved").await.unwrap();
        assert_eq!(cold(dir.path(), "moved/e/small").unwrap(), b"hi");
        assert_eq!(cold(dir.path(), "moved/big.bin").unwrap().len(), 20_000);
        assert!(!dir.path().join("cold/d").exists());
    }

    #[tokio::test]
    async fn a_file_still_being_written_inside_goes_up_under_its_new_name() {
        let dir = tempfile::tempdir().unwrap();
        let fs = setup(dir.path());
        let a = fs.mkdir(ROOT, "a").await.unwrap();
        write(&fs, a.ino, "done", b"1").await;
        let (_, fh) = fs.create(a.ino, "open").await.unwrap();
        fs.write(fh, 0, b"first").await.unwrap();
        fs.rename(ROOT, "a", ROOT, "b").await.unwrap();
        fs.write(fh, 5, b" second").await.unwrap();
        fs.release(fh).await.unwrap();
        assert_eq!(cold(dir.path(), "b/open").unwrap(), b"first second");
        assert_eq!(cold(dir.path(), "b/done").unwrap(), b"1");
        assert!(!dir.path().join("cold/a").exists(), "nothing went up under the old name");
    }

    #[tokio::test]
    async fn a_rename_cut_short_by_a_crash_is_finished_at_the_next_start() {
        let dir = tempfile::tempdir().unwrap();
        let cold_dir = dir.path().join("cold");
        // The crash came after one of three files was copied and none was deleted.
        for f in ["x", "y", "sub/z"] {
            let p = cold_dir.join("ck.tmp").join(f);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(&p, f.as_bytes()).unwrap();
        }
        std::fs::create_dir_all(cold_dir.join("ck")).unwrap();
        std::fs::write(cold_dir.join("ck/x"), b"x").unwrap();
        write_journal(&dir.path().join("staging"), &Journal { from: "ck.tmp".into(), to: "ck".into() }).unwrap();

        let fs = setup(dir.path());
        let report = fs.recover_renames().await;
        assert_eq!(report.len(), 1, "{report:?}");
        assert!(report[0].contains("ck.tmp -> ck") && report[0].contains("finished"), "{report:?}");
        for f in ["x", "y", "sub/z"] {
            assert_eq!(cold(dir.path(), &format!("ck/{f}")).unwrap(), f.as_bytes());
        }
        assert!(!cold_dir.join("ck.tmp").exists());
        assert!(fs.recover_renames().await.is_empty(), "the journal is gone once the rename is finished");
    }
}
