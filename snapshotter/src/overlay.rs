//! Overlay snapshots with the semantics of containerd's overlayfs snapshotter: each snapshot
//! is a directory `snapshots/<id>/fs` (plus `work` when active), stacked by the caller's
//! overlay mount with the nearest parent first.

use crate::error::SnapshotError;
use crate::filter::Filter;
use crate::model::{Info, Kind, Mount, Usage};
use crate::store::{MetaStore, Record, now};
use crate::usage::disk_usage;
use std::collections::BTreeMap;
use std::os::unix::fs::{DirBuilderExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// The snapshotter's state under one root directory.
#[derive(Debug)]
pub struct Snapshotter {
    root: PathBuf,
    store: Mutex<MetaStore>,
    /// Ids below this may name directories a crash left without metadata.
    id_floor: u64,
    /// Whether the kernel's overlay has an `index` feature to turn off, as containerd does, so
    /// that layers can be mounted again under other upper dirs.
    index_off: bool,
}

const METADATA: &str = "metadata.json";

impl Snapshotter {
    pub fn open(root: &Path) -> Result<Snapshotter, SnapshotError> {
        let snapshots = root.join("snapshots");
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&snapshots)
            .map_err(SnapshotError::io("cannot create", &snapshots))?;
        let store = MetaStore::open(&root.join(METADATA))?;
        let mut id_floor = 0;
        for entry in std::fs::read_dir(&snapshots).map_err(SnapshotError::io("cannot list", &snapshots))? {
            let entry = entry.map_err(SnapshotError::io("cannot list", &snapshots))?;
            // Leftovers of a create or a remove cut short (`new-N`, `rm-N`) count too: an id
            // handed out again would find its `new-N` still there and fail that Prepare.
            let name = entry.file_name();
            let id = name.to_str().map(|n| n.strip_prefix("new-").or_else(|| n.strip_prefix("rm-")).unwrap_or(n));
            if let Some(id) = id.and_then(|n| n.parse::<u64>().ok()) {
                id_floor = id_floor.max(id + 1);
            }
        }
        Ok(Snapshotter {
            root: root.to_owned(),
            store: Mutex::new(store),
            id_floor,
            index_off: Path::new("/sys/module/overlay/parameters/index").exists(),
        })
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    fn dir(&self, id: u64) -> PathBuf {
        self.root.join("snapshots").join(id.to_string())
    }

    fn fs_dir(&self, id: u64) -> PathBuf {
        self.dir(id).join("fs")
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, MetaStore> {
        // A panic while holding the lock cannot leave the store half-changed (changes are
        // applied to a copy), so a poisoned lock is safe to use.
        self.store.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A writable snapshot on `parent`, and the mounts that show it.
    pub fn prepare(
        &self,
        key: &str,
        parent: Option<&str>,
        labels: BTreeMap<String, String>,
    ) -> Result<Vec<Mount>, SnapshotError> {
        self.create(Kind::Active, key, parent, labels)
    }

    /// A read-only view of `parent`.
    pub fn view(
        &self,
        key: &str,
        parent: Option<&str>,
        labels: BTreeMap<String, String>,
    ) -> Result<Vec<Mount>, SnapshotError> {
        self.create(Kind::View, key, parent, labels)
    }

    fn create(
        &self,
        kind: Kind,
        key: &str,
        parent: Option<&str>,
        labels: BTreeMap<String, String>,
    ) -> Result<Vec<Mount>, SnapshotError> {
        if key.is_empty() {
            return Err(SnapshotError::InvalidArgument("a snapshot key must not be empty".into()));
        }
        let mut store = self.lock();
        if store.get(key).is_some() {
            return Err(SnapshotError::AlreadyExists(key.to_owned()));
        }
        let parent_record = match parent {
            Some(p) => {
                let r = store.get(p).ok_or_else(|| SnapshotError::ParentNotFound(p.to_owned()))?;
                if r.kind != Kind::Committed {
                    return Err(SnapshotError::ParentNotCommitted(p.to_owned()));
                }
                Some(r.clone())
            }
            None => None,
        };
        let id = store.allocate_id(self.id_floor);
        // Built under a temporary name, so a crash never leaves a directory that looks like
        // a snapshot but has no metadata; Cleanup removes such leftovers.
        let tmp = self.root.join("snapshots").join(format!("new-{id}"));
        let built = self.build_dirs(&tmp, kind, parent_record.as_ref());
        let placed = built.and_then(|()| {
            std::fs::rename(&tmp, self.dir(id)).map_err(SnapshotError::io("cannot place snapshot", self.dir(id)))?;
            // The new name is on disk before the metadata that points at it is.
            let snapshots = self.root.join("snapshots");
            std::fs::File::open(&snapshots)
                .and_then(|d| d.sync_all())
                .map_err(SnapshotError::io("cannot sync", &snapshots))
        });
        if let Err(e) = placed {
            let _ = std::fs::remove_dir_all(&tmp);
            return Err(e);
        }
        let t = now();
        let record = Record {
            id,
            kind,
            parent: parent.map(str::to_owned),
            labels,
            created: t,
            updated: t,
            usage: Usage::default(),
        };
        let saved = store.update(|m| {
            m.insert(key.to_owned(), record.clone());
            Ok(())
        });
        if let Err(e) = saved {
            let _ = std::fs::remove_dir_all(self.dir(id));
            return Err(e);
        }
        Ok(self.mounts_of(&store, &record))
    }

    fn build_dirs(&self, dir: &Path, kind: Kind, parent: Option<&Record>) -> Result<(), SnapshotError> {
        let fs = dir.join("fs");
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o755)
            .create(&fs)
            .map_err(SnapshotError::io("cannot create", &fs))?;
        if kind == Kind::Active {
            let work = dir.join("work");
            std::fs::DirBuilder::new().mode(0o711).create(&work).map_err(SnapshotError::io("cannot create", &work))?;
        }
        if let Some(p) = parent {
            // The overlay's root takes its owner from the upper dir, so the upper dir takes
            // the parent's, as containerd's overlayfs snapshotter does.
            let pfs = self.fs_dir(p.id);
            let meta = std::fs::metadata(&pfs).map_err(SnapshotError::io("cannot stat parent layer", &pfs))?;
            std::os::unix::fs::lchown(&fs, Some(meta.uid()), Some(meta.gid()))
                .map_err(SnapshotError::io("cannot chown", &fs))?;
        }
        Ok(())
    }

    /// Makes the active snapshot `key` the committed snapshot `name`, with `labels`.
    pub fn commit(&self, name: &str, key: &str, labels: BTreeMap<String, String>) -> Result<(), SnapshotError> {
        if name.is_empty() {
            return Err(SnapshotError::InvalidArgument("a snapshot name must not be empty".into()));
        }
        let check = |store: &MetaStore| -> Result<Record, SnapshotError> {
            let record = store.get(key).ok_or_else(|| SnapshotError::NotFound(key.to_owned()))?.clone();
            if record.kind != Kind::Active {
                return Err(SnapshotError::NotActive { key: key.to_owned(), kind: record.kind.as_str() });
            }
            if store.get(name).is_some() {
                return Err(SnapshotError::AlreadyExists(name.to_owned()));
            }
            Ok(record)
        };
        let id = check(&self.lock())?.id;
        // Measured without the store's lock, which every other call takes: walking a large
        // layer unpacked here takes seconds, and the other layers of a pull would wait on it.
        // A remote layer's files live in the registry: walking its mount would only count what
        // the TOC says, at the cost of a stat per file.
        let usage = if labels.contains_key(crate::lazy::REMOTE_LABEL) {
            Usage::default()
        } else {
            disk_usage(&self.fs_dir(id))?
        };
        let mut store = self.lock();
        let record = check(&store)?;
        if record.id != id {
            // Removed and prepared again under the same key meanwhile: this commit was of the
            // snapshot that went.
            return Err(SnapshotError::NotFound(key.to_owned()));
        }
        let t = now();
        store.update(|m| {
            m.remove(key);
            m.insert(
                name.to_owned(),
                Record { kind: Kind::Committed, labels, created: t, updated: t, usage, ..record },
            );
            Ok(())
        })
    }

    /// Removes a snapshot that nothing is built on, with its directory.
    pub fn remove(&self, key: &str) -> Result<(), SnapshotError> {
        let mut store = self.lock();
        let record = store.get(key).ok_or_else(|| SnapshotError::NotFound(key.to_owned()))?.clone();
        if store.has_children(key) {
            return Err(SnapshotError::HasChildren(key.to_owned()));
        }
        store.update(|m| {
            m.remove(key);
            Ok(())
        })?;
        drop(store);
        // The metadata is gone, so the snapshot is gone; a directory that resists removal is
        // only disk space, which Cleanup takes back later.
        let doomed = self.root.join("snapshots").join(format!("rm-{}", record.id));
        let removed = std::fs::rename(self.dir(record.id), &doomed).and_then(|()| std::fs::remove_dir_all(&doomed));
        if let Err(e) = removed {
            tracing::warn!(key, id = record.id, error = %e, "snapshot removed, but not its directory yet");
        }
        Ok(())
    }

    /// The directory id of snapshot `key` and the layer directory (`fs`) it owns.
    pub fn layer_dir(&self, key: &str) -> Result<(u64, PathBuf), SnapshotError> {
        let store = self.lock();
        let record = store.get(key).ok_or_else(|| SnapshotError::NotFound(key.to_owned()))?;
        Ok((record.id, self.fs_dir(record.id)))
    }

    /// The id of a snapshot that [`Snapshotter::remove`] would remove now.
    pub fn removable(&self, key: &str) -> Result<u64, SnapshotError> {
        let store = self.lock();
        let record = store.get(key).ok_or_else(|| SnapshotError::NotFound(key.to_owned()))?;
        if store.has_children(key) {
            return Err(SnapshotError::HasChildren(key.to_owned()));
        }
        Ok(record.id)
    }

    /// The snapshot and its ancestors, nearest first, with their ids and labels.
    pub fn chain(&self, key: &str) -> Vec<(String, u64, BTreeMap<String, String>)> {
        let store = self.lock();
        let mut out = Vec::new();
        let mut next = Some(key.to_owned());
        while let Some(k) = next {
            let Some(r) = store.get(&k) else { break };
            out.push((k.clone(), r.id, r.labels.clone()));
            next = r.parent.clone();
        }
        out
    }

    pub fn stat(&self, key: &str) -> Result<Info, SnapshotError> {
        let store = self.lock();
        let record = store.get(key).ok_or_else(|| SnapshotError::NotFound(key.to_owned()))?;
        Ok(info(key, record))
    }

    /// Changes a snapshot's labels: all of them when `paths` is empty or holds `labels`, or
    /// the named `labels.KEY` ones, where an empty value removes the label.
    pub fn update(&self, new: &Info, paths: &[String]) -> Result<Info, SnapshotError> {
        if new.name.is_empty() {
            return Err(SnapshotError::InvalidArgument("an update must name its snapshot".into()));
        }
        let mut store = self.lock();
        let mut record = store.get(&new.name).ok_or_else(|| SnapshotError::NotFound(new.name.clone()))?.clone();
        if paths.is_empty() {
            record.labels = new.labels.clone();
        }
        for path in paths {
            if path == "labels" {
                record.labels = new.labels.clone();
            } else if let Some(label) = path.strip_prefix("labels.") {
                match new.labels.get(label) {
                    Some(v) if !v.is_empty() => record.labels.insert(label.to_owned(), v.clone()),
                    _ => record.labels.remove(label),
                };
            } else {
                return Err(SnapshotError::InvalidArgument(format!(
                    "cannot update field {path:?} of snapshot {:?}: only labels can change",
                    new.name
                )));
            }
        }
        record.labels.retain(|_, v| !v.is_empty());
        record.updated = now();
        store.update(|m| {
            m.insert(new.name.clone(), record.clone());
            Ok(())
        })?;
        Ok(info(&new.name, &record))
    }

    /// The space a snapshot's own layer takes: measured now for an active snapshot, as at
    /// Commit for a committed one.
    pub fn usage(&self, key: &str) -> Result<Usage, SnapshotError> {
        let record = self.lock().get(key).ok_or_else(|| SnapshotError::NotFound(key.to_owned()))?.clone();
        match record.kind {
            Kind::Active => disk_usage(&self.fs_dir(record.id)),
            _ => Ok(record.usage),
        }
    }

    pub fn mounts(&self, key: &str) -> Result<Vec<Mount>, SnapshotError> {
        let store = self.lock();
        let record = store.get(key).ok_or_else(|| SnapshotError::NotFound(key.to_owned()))?;
        if record.kind == Kind::Committed {
            return Err(SnapshotError::NoMounts(key.to_owned()));
        }
        Ok(self.mounts_of(&store, record))
    }

    pub fn list(&self, filters: &[String]) -> Result<Vec<Info>, SnapshotError> {
        let filter = Filter::parse(filters)?;
        let store = self.lock();
        Ok(store.iter().map(|(k, r)| info(k, r)).filter(|i| filter.matches(i)).collect())
    }

    /// Removes directories that no snapshot owns: leftovers of crashes and of removals that
    /// failed part-way.
    pub fn cleanup(&self) -> Result<u64, SnapshotError> {
        let store = self.lock();
        let owned: std::collections::HashSet<String> = store.iter().map(|(_, r)| r.id.to_string()).collect();
        let snapshots = self.root.join("snapshots");
        let mut removed = 0;
        for entry in std::fs::read_dir(&snapshots).map_err(SnapshotError::io("cannot list", &snapshots))? {
            let entry = entry.map_err(SnapshotError::io("cannot list", &snapshots))?;
            let name = entry.file_name().to_string_lossy().into_owned();
            if owned.contains(&name) {
                continue;
            }
            let path = entry.path();
            // One directory that will not go (a mount still on it, say) must not keep every
            // other leftover, nor fail every later Cleanup: it is logged, and tried again next
            // time. One already gone (a Remove that ran meanwhile) is no failure.
            match std::fs::remove_dir_all(&path) {
                Ok(()) => removed += 1,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => {
                    tracing::warn!(path = %path.display(), error = %e, "cleanup could not remove a leftover directory")
                }
            }
        }
        Ok(removed)
    }

    fn mounts_of(&self, store: &MetaStore, record: &Record) -> Vec<Mount> {
        let mut lower = Vec::new();
        let mut next = record.parent.as_deref();
        while let Some(p) = next {
            let Some(r) = store.get(p) else { break };
            lower.push(self.fs_dir(r.id));
            next = r.parent.as_deref();
        }
        let path = |p: &Path| p.to_string_lossy().into_owned();
        if lower.is_empty() {
            let mode = if record.kind == Kind::View { "ro" } else { "rw" };
            return vec![Mount {
                kind: "bind".into(),
                source: path(&self.fs_dir(record.id)),
                options: vec![mode.into(), "rbind".into()],
            }];
        }
        if record.kind != Kind::Active && lower.len() == 1 {
            return vec![Mount {
                kind: "bind".into(),
                source: path(&lower[0]),
                options: vec!["ro".into(), "rbind".into()],
            }];
        }
        let mut options = Vec::new();
        if self.index_off {
            options.push("index=off".to_owned());
        }
        if record.kind == Kind::Active {
            options.push(format!("workdir={}", path(&self.dir(record.id).join("work"))));
            options.push(format!("upperdir={}", path(&self.fs_dir(record.id))));
        }
        let lowers: Vec<String> = lower.iter().map(|p| path(p)).collect();
        options.push(format!("lowerdir={}", lowers.join(":")));
        vec![Mount { kind: "overlay".into(), source: "overlay".into(), options }]
    }
}

fn info(key: &str, r: &Record) -> Info {
    Info {
        name: key.to_owned(),
        parent: r.parent.clone(),
        kind: r.kind,
        labels: r.labels.clone(),
        created: r.created,
        updated: r.updated,
    }
}
