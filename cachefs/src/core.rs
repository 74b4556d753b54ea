//! The filesystem core, free of FUSE: inodes, cached directory listings, open handles and reads
//! through the tiered cache. The FUSE adapter is a thin shell over this, and tests can drive it
//! without the kernel.

mod dir_rename;
pub use dir_rename::read_journal;
#[cfg(test)]
mod race_tests;
#[cfg(test)]
mod rewrite_tests;

use crate::namespace::{Namespace, Node, NodeKind, NsError};
use crate::readahead::ReadAhead;
use crate::resume::{HandleRecord, Journal, Record, Restored};
use crate::staging::{self, Staged};
use crate::streaming::StreamError;
use crate::window::{ChunkFuture, Window};
use bytes::{Bytes, BytesMut};
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant, SystemTime};
use strata_tiering::{CacheError, Fetcher, TieredCache};

pub const ROOT: u64 = 1;

/// A reader that has not read for this long gives back the memory its read-ahead holds when
/// another reader needs it.
const IDLE_READER: Duration = Duration::from_secs(2);

/// How long a closed file's staged bytes wait before going into the cache, for a rename.
const RENAME_SETTLE: Duration = Duration::from_millis(500);

#[derive(Debug, thiserror::Error)]
pub enum FsError {
    #[error("no such file or directory")]
    NotFound,
    #[error("not a directory")]
    NotDir,
    #[error("is a directory")]
    IsDir,
    #[error("stale file handle")]
    BadHandle,
    #[error("listing {dir} failed: {source}")]
    List { dir: String, source: NsError },
    #[error("reading {path} failed: {source}")]
    Read { path: String, source: Arc<CacheError> },
    #[error("{0}")]
    NotSupported(&'static str),
    #[error("already exists")]
    Exists,
    #[error("directory not empty")]
    NotEmpty,
    #[error("{0}")]
    Invalid(&'static str),
    #[error("not open for writing")]
    NotWritable,
    #[error("staging {path} failed: {source}")]
    Stage { path: String, source: std::io::Error },
    #[error("uploading {path} failed: {source}")]
    Publish { path: String, source: NsError },
    #[error("{what} {path} failed: {source}")]
    Namespace { what: &'static str, path: String, source: NsError },
}

/// What the kernel is told about an inode.
#[derive(Debug, Clone, PartialEq)]
pub struct Attr {
    pub ino: u64,
    pub kind: NodeKind,
    pub size: u64,
    pub mtime: SystemTime,
    /// Owner and mode from the namespace, when it has them.
    pub posix: Option<crate::namespace::Posix>,
}

#[derive(Debug, Clone)]
struct Inode {
    path: String,
    node: Node,
}

#[derive(Debug, Default)]
struct Inodes {
    by_ino: HashMap<u64, Inode>,
    by_path: HashMap<String, u64>,
    /// The inode of each hard-link group: every name of one file has its inode.
    by_link: HashMap<u64, u64>,
    next: u64,
    /// Changes this mount made to the tree, counted as they are made: a listing or a lookup
    /// that asked the store while one was made may describe the tree from before it, and must
    /// neither undo it nor be cached.
    changes: u64,
    /// For each directory a change touched, the count at its last change: only answers about
    /// that directory are asked for again, so a checkpoint written in one directory does not
    /// make a long listing of another start over.
    changed: HashMap<String, (u64, Instant)>,
    /// The count when `changed` was last emptied, to bound it: an answer asked for before
    /// then counts as raced, whatever its directory.
    changed_floor: u64,
    /// When `changed` was last emptied.
    changed_floor_at: Option<Instant>,
    /// Where each inode given out is written down, for a successor (see `resume`).
    journal: Option<Arc<Journal>>,
}

impl Inodes {
    /// The inode of `path` (stable for the life of the mount), now showing `node`. The first
    /// name of a hard-link group stays the inode's path.
    fn assign(&mut self, path: &str, node: Node) -> u64 {
        let link = node.posix.and_then(|p| p.link);
        let known = self.by_path.get(path).copied().or_else(|| link.and_then(|l| self.by_link.get(&l).copied()));
        let ino = known.unwrap_or_else(|| {
            self.next += 1;
            self.next - 1
        });
        self.by_path.insert(path.to_string(), ino);
        if let Some(l) = link {
            self.by_link.insert(l, ino);
        }
        let same = self.journal.is_none() || self.by_ino.get(&ino).is_some_and(|i| i.path == path && i.node == node);
        match self.by_ino.get_mut(&ino) {
            Some(i) if i.path != path && link.is_some() => i.node = Node { name: i.node.name.clone(), ..node },
            _ => {
                self.by_ino.insert(ino, Inode { path: path.to_string(), node });
            }
        }
        if !same {
            self.note(ino);
        }
        ino
    }

    /// Sets what inode `ino` is.
    fn put(&mut self, ino: u64, inode: Inode) {
        self.by_ino.insert(ino, inode);
        self.note(ino);
    }

    /// Writes down what inode `ino` is now, if a journal is kept.
    fn note(&self, ino: u64) {
        if let (Some(j), Some(i)) = (&self.journal, self.by_ino.get(&ino)) {
            j.append(&Record::Inode { ino, path: i.path.clone(), node: i.node.clone() });
        }
    }

    /// Counts a change of the tree touching `paths`: the directory of each changed now.
    fn touch(&mut self, paths: &[&str]) {
        self.changes += 1;
        let now = Instant::now();
        if self.changed.len() > MAX_CHANGED_DIRS {
            self.changed.clear();
            self.changed_floor = self.changes;
            self.changed_floor_at = Some(now);
        }
        for p in paths {
            let parent = p.rsplit_once('/').map(|(d, _)| d).unwrap_or("");
            self.changed.insert(parent.to_owned(), (self.changes, now));
        }
    }

    /// Whether the directory `dir` changed here after the count was `seen`.
    fn changed_since(&self, dir: &str, seen: u64) -> bool {
        seen < self.changed_floor || self.changed.get(dir).is_some_and(|&(at, _)| at > seen)
    }

    /// How long ago this mount last changed directory `dir`, if it remembers a change: an
    /// answer that a peer had for the cluster from before then may not show it.
    fn unchanged_for(&self, dir: &str) -> Option<Duration> {
        self.changed.get(dir).map(|&(_, at)| at).or(self.changed_floor_at).map(|at| at.elapsed())
    }

    /// The inode of `path` for an answer the store gave while this mount was changing the
    /// tree (`current` false), or about a file being written here: the inode's own node is
    /// newer than the answer, and stays; only a path not known here is assigned the answer.
    fn assign_answer(&mut self, path: &str, node: &Node, current: bool, writing: &HashSet<u64>) -> (u64, Node) {
        match self.by_path.get(path).copied() {
            Some(ino) if !current || writing.contains(&ino) => match self.by_ino.get(&ino) {
                Some(i) => (ino, Node { name: node.name.clone(), ..i.node.clone() }),
                None => (self.assign(path, node.clone()), node.clone()),
            },
            _ => (self.assign(path, node.clone()), node.clone()),
        }
    }
}

/// Directories whose last change is remembered; past this, the memory starts again.
const MAX_CHANGED_DIRS: usize = 65_536;

/// How many times a listing or lookup asks the store again after this mount changed the tree
/// during its request, before it answers without caching.
const RACED_TRIES: u32 = 3;

/// How long an entry of an immutable mount (no TTL) is trusted: the mount's life.
const IMMUTABLE: Duration = Duration::from_secs(100 * 365 * 86400);

/// A listing and when it was taken.
#[derive(Debug)]
struct Listing {
    at: Instant,
    entries: Arc<Vec<(u64, Node)>>,
}

/// An open file: the version it was opened at, so a reader never mixes two versions, or the
/// staged content a writer is producing.
struct Handle {
    ino: u64,
    path: String,
    node: Node,
    fetcher: Arc<dyn Fetcher>,
    staged: Option<Arc<tokio::sync::Mutex<Staged>>>,
    /// Opened for writing on an existing object: reads work, writes are refused.
    in_place: bool,
    ahead: Mutex<ReadAhead>,
    window: Mutex<Window>,
}

/// Settings of the core.
#[derive(Debug, Clone)]
pub struct FsOptions {
    /// How long a directory listing, or one looked-up entry, is trusted before it is asked for
    /// again; an entry asked for again is revalidated by its ETag. `None`: forever (an
    /// immutable dataset).
    pub metadata_ttl: Option<Duration>,
    /// How long a name found missing is answered as missing without asking the store.
    pub negative_ttl: Duration,
    /// Where files being written are staged until they are uploaded; `None` makes the
    /// filesystem read-only.
    pub staging_dir: Option<std::path::PathBuf>,
    /// Bytes of chunk fetches in flight, reads and read-ahead together; the mount's memory
    /// budget for data. Read-ahead gets at most half and never waits for it.
    pub memory_budget: u64,
    /// Largest read-ahead window per open file.
    pub max_read_ahead: u64,
    /// Keep the newest file written into each directory (and the newest directory this mount
    /// made in its parent) pinned in the hot tier, so a restart after a failure reads the
    /// latest checkpoint from local disk.
    pub keep_newest_hot: bool,
    /// A directory whose files were all written within this window of its first write counts
    /// as one checkpoint (a step directory of shards); one written into over a longer time is
    /// a directory of checkpoints.
    pub checkpoint_window: Duration,
    /// Keep whole-file copies of files whose chunks are all hot, so opens can hand the kernel
    /// a backing file (FUSE passthrough) and reads never reach us.
    pub passthrough: bool,
}

pub struct FsCore {
    ns: Arc<dyn Namespace>,
    cache: TieredCache,
    opts: FsOptions,
    inodes: RwLock<Inodes>,
    listings: Mutex<HashMap<u64, Listing>>,
    /// Names looked up one by one, outside a fresh listing: (parent, name) to inode, and
    /// until when (an answer a peer had for the cluster is trusted for what is left of the TTL).
    entries: moka::sync::Cache<(u64, String), (u64, Instant)>,
    /// Names looked up and found missing, until when.
    negative: moka::sync::Cache<(u64, String), Instant>,
    handles: Mutex<HashMap<u64, Arc<Handle>>>,
    next_fh: std::sync::atomic::AtomicU64,
    /// Files being written, by inode.
    writers: Mutex<HashMap<u64, Arc<tokio::sync::Mutex<Staged>>>>,
    /// Staged copies whose last handle is gone and whose release is publishing them, oldest
    /// first (a file's next copy starts only once its last one is here). No new open joins
    /// one (it starts a copy of its own), but an unlink, or a rename onto or of the name, still
    /// reaches them, and a newer copy's upload waits for them.
    closing: Mutex<HashMap<u64, Vec<Arc<tokio::sync::Mutex<Staged>>>>>,
    /// The newest staged copy of each file being written or published, by its id: an older
    /// copy whose release comes after a truncating open started the file again is not
    /// uploaded, since that open emptied it, as it would on a local disk.
    newest: Mutex<HashMap<u64, u64>>,
    /// Entries that exist here but not (yet) in the store: files being written, new directories.
    pending: Mutex<HashMap<String, Node>>,
    next_stage: std::sync::atomic::AtomicU64,
    demand: Arc<tokio::sync::Semaphore>,
    ahead: Arc<tokio::sync::Semaphore>,
    keeper: Arc<crate::keeper::Keeper>,
    /// Inodes being renamed right now.
    renaming: Mutex<std::collections::HashSet<u64>>,
    /// For each inode whose current object this mount uploaded: the staged copy that held its
    /// bytes (by stage id) and the object's version, followed through renames. A staged copy
    /// becomes the cache of the object only if this still names it: by the time a late release
    /// gets there, the file may have been rewritten, with the same size and even the same
    /// version string.
    published: Mutex<HashMap<u64, (u64, String)>>,
    /// Where open read handles are written down, for a successor (see `resume`).
    journal: std::sync::OnceLock<Arc<Journal>>,
}

/// Marks an inode as being renamed for as long as it lives.
struct Renaming<'a> {
    set: &'a Mutex<std::collections::HashSet<u64>>,
    ino: u64,
}

impl<'a> Renaming<'a> {
    fn start(set: &'a Mutex<std::collections::HashSet<u64>>, ino: u64) -> Self {
        set.lock().unwrap_or_else(|p| p.into_inner()).insert(ino);
        Renaming { set, ino }
    }
}

impl Drop for Renaming<'_> {
    fn drop(&mut self) {
        self.set.lock().unwrap_or_else(|p| p.into_inner()).remove(&self.ino);
    }
}

impl std::fmt::Debug for FsCore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FsCore").field("ns", &self.ns.describe()).finish()
    }
}

fn join(dir: &str, name: &str) -> String {
    if dir.is_empty() { name.to_string() } else { format!("{dir}/{name}") }
}

/// Records the ID of an upload of a staged file in its manifest, so that a restart after a
/// crash aborts the upload; without it, the parts would stay in the store.
fn note_upload(manifest: &std::path::Path) -> crate::namespace::UploadNote {
    let manifest = manifest.to_path_buf();
    Box::new(move |id: &str| {
        if let Err(e) = staging::note_upload_in(&manifest, id) {
            tracing::warn!(manifest = %manifest.display(), error = %e, "cannot record the upload's ID; a crash now would leave its parts in the store");
        }
    })
}

impl FsCore {
    pub fn new(ns: Arc<dyn Namespace>, cache: TieredCache, opts: FsOptions) -> FsCore {
        let root = ns.root().unwrap_or_else(|| Node::dir("", SystemTime::UNIX_EPOCH));
        let mut inodes = Inodes { next: ROOT + 1, ..Default::default() };
        inodes.by_ino.insert(ROOT, Inode { path: String::new(), node: root });
        inodes.by_path.insert(String::new(), ROOT);
        let next_stage = opts.staging_dir.as_deref().map(staging::next_id).unwrap_or(1);
        let chunks = (opts.memory_budget / ns.chunk_size().max(1)).max(2) as usize;
        let entries = {
            let b = moka::sync::Cache::builder().max_capacity(1_000_000);
            match opts.metadata_ttl {
                Some(ttl) => b.time_to_live(ttl).build(),
                None => b.build(),
            }
        };
        let negative = moka::sync::Cache::builder().max_capacity(100_000).time_to_live(opts.negative_ttl).build();
        let assemble = opts.passthrough.then(|| crate::assemble::start(ns.clone(), cache.clone())).flatten();
        let keeper = Arc::new(crate::keeper::Keeper {
            ns: ns.clone(),
            cache: cache.clone(),
            keep_newest_hot: opts.keep_newest_hot,
            checkpoint_window: opts.checkpoint_window,
            first_write: Mutex::new(HashMap::new()),
            order: tokio::sync::Mutex::new(()),
            assemble,
        });
        FsCore {
            keeper,
            ns,
            cache,
            opts,
            inodes: RwLock::new(inodes),
            listings: Mutex::new(HashMap::new()),
            entries,
            negative,
            handles: Mutex::new(HashMap::new()),
            next_fh: std::sync::atomic::AtomicU64::new(1),
            writers: Mutex::new(HashMap::new()),
            closing: Mutex::new(HashMap::new()),
            newest: Mutex::new(HashMap::new()),
            pending: Mutex::new(HashMap::new()),
            next_stage: std::sync::atomic::AtomicU64::new(next_stage),
            demand: Arc::new(tokio::sync::Semaphore::new(chunks - chunks / 2)),
            ahead: Arc::new(tokio::sync::Semaphore::new(chunks / 2)),
            renaming: Mutex::new(Default::default()),
            published: Mutex::new(HashMap::new()),
            journal: std::sync::OnceLock::new(),
        }
    }

    /// Deals with files staged by a previous run. A complete one (its writer had flushed or
    /// closed it, and the upload may have been cut short) is uploaded again when `upload` is set;
    /// an incomplete one (cut off mid-write) is never uploaded, because the object must be absent
    /// or whole. Returns one line per file for the operator, which the caller logs.
    pub async fn recover_staged(&self, upload: bool) -> Vec<String> {
        let Some(dir) = &self.opts.staging_dir else { return Vec::new() };
        let mut report = Vec::new();
        for l in staging::leftovers(dir) {
            let target = &l.manifest.target;
            if let Some(id) = &l.manifest.upload {
                // The upload the crash cut short, streamed while the file was written or whole
                // at its close: whatever happens to the file now, that upload is over.
                match self.ns.abort_upload(target, id).await {
                    Ok(()) => {
                        self.cache.metrics().fs_uploads_aborted_at_start.inc();
                        tracing::info!(path = %target, "a previous run's unfinished upload was aborted");
                    }
                    Err(e) => {
                        tracing::warn!(path = %target, error = %e, "aborting a previous run's unfinished upload failed; the bucket's lifecycle rule for unfinished uploads removes its parts")
                    }
                }
            }
            let line = if l.manifest.failed {
                format!(
                    "{target}: its upload failed and the writer was told; not uploaded, kept at {}",
                    l.data.display()
                )
            } else if !l.manifest.complete {
                format!("{target}: left incomplete by a crash mid-write; not uploaded, kept at {}", l.data.display())
            } else if !staging::holds_recorded_content(&l.manifest, &l.data).unwrap_or(false) {
                format!(
                    "{target}: complete when written, but a crash damaged the staged copy before it reached the disk; not uploaded, kept at {}",
                    l.data.display()
                )
            } else if !upload {
                format!(
                    "{target}: complete but not uploaded (upload of leftovers is off); kept at {}",
                    l.data.display()
                )
            } else {
                match self.ns.publish(target, &l.data, note_upload(&l.manifest_path)).await {
                    Ok(_) => {
                        let _ = std::fs::remove_file(&l.data);
                        let _ = std::fs::remove_file(&l.manifest_path);
                        format!("{target}: uploaded from a previous run's staging")
                    }
                    Err(e) => format!(
                        "{target}: upload from a previous run's staging failed: {e}; kept at {}",
                        l.data.display()
                    ),
                }
            };
            report.push(line);
        }
        staging::remove_orphans(dir);
        report
    }

    /// Counts a flush by another process than the writer's, which published nothing.
    pub fn count_foreign_flush(&self) {
        self.cache.metrics().fs_foreign_flushes.inc();
    }

    /// Counts an open by how its reads are served.
    pub fn count_open(&self, mode: &'static str) {
        self.cache.metrics().fs_opens.get_or_create(&strata_tiering::metrics::OpenLabel { mode }).inc();
    }

    pub fn passthrough_wanted(&self) -> bool {
        self.keeper.assemble.is_some()
    }

    pub fn writable(&self) -> bool {
        self.opts.staging_dir.is_some()
    }

    /// Where writes are staged; `None` for a read-only mount.
    pub fn staging_dir(&self) -> Option<&std::path::Path> {
        self.opts.staging_dir.as_deref()
    }

    pub fn describe(&self) -> String {
        self.ns.describe()
    }

    fn inode(&self, ino: u64) -> Result<Inode, FsError> {
        self.inodes.read().unwrap_or_else(|p| p.into_inner()).by_ino.get(&ino).cloned().ok_or(FsError::NotFound)
    }

    fn attr(ino: u64, node: &Node) -> Attr {
        Attr { ino, kind: node.kind, size: node.size, mtime: node.mtime, posix: node.posix }
    }

    /// The target of a symlink.
    pub async fn readlink(&self, ino: u64) -> Result<String, FsError> {
        let i = self.inode(ino)?;
        if i.node.kind != NodeKind::Symlink {
            return Err(FsError::NotSupported("not a symlink"));
        }
        self.ns.read_link(&i.path).await.map_err(|source| FsError::Namespace { what: "readlink", path: i.path, source })
    }

    /// The extended attributes of an inode.
    pub async fn xattrs(&self, ino: u64) -> Result<std::collections::BTreeMap<String, Vec<u8>>, FsError> {
        let i = self.inode(ino)?;
        self.ns.xattrs(&i.path).await.map_err(|source| FsError::Namespace { what: "getxattr", path: i.path, source })
    }

    /// The entries of a directory, listed at most once per TTL. Inode numbers are stable for a
    /// path for the life of the mount; a new listing refreshes the nodes (sizes, ETags), except
    /// those this mount changed while the listing was on its way.
    async fn listing(&self, ino: u64) -> Result<Arc<Vec<(u64, Node)>>, FsError> {
        let mut tries = 0;
        loop {
            tries += 1;
            if let Some(entries) = self.fresh_listing(ino) {
                return Ok(entries);
            }
            // Before the directory's path is read: a move of the directory after this is seen.
            let seen = self.changes();
            let dir = self.inode(ino)?;
            if dir.node.kind != NodeKind::Dir {
                return Err(FsError::NotDir);
            }
            // A listing a peer made for the cluster counts as made when it was, not now.
            let (mut nodes, age) =
                self.ns.read_dir_aged(&dir.path, self.max_age(&dir.path)).await.map_err(|source| FsError::List {
                    dir: if dir.path.is_empty() { "/".into() } else { dir.path.clone() },
                    source,
                })?;
            let listed_at = Instant::now().checked_sub(age).unwrap_or_else(Instant::now);
            {
                // Files being written and new directories exist here before the store has them.
                let pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
                for (path, node) in pending.iter() {
                    let parent = path.rsplit_once('/').map(|(d, _)| d).unwrap_or("");
                    if parent == dir.path && !nodes.iter().any(|n| n.name == node.name) {
                        nodes.push(node.clone());
                    }
                }
            }
            let writing = self.writing();
            // Under the inodes' lock, which every change of the tree here takes to count
            // itself: a change counted after this check comes after this listing, and
            // forgets it.
            let mut t = self.inodes.write().unwrap_or_else(|p| p.into_inner());
            let current = !t.changed_since(&dir.path, seen);
            if !current && tries < RACED_TRIES {
                continue;
            }
            let entries: Vec<(u64, Node)> = nodes
                .iter()
                .map(|node| t.assign_answer(&join(&dir.path, &node.name), node, current, &writing))
                .collect();
            let entries = Arc::new(entries);
            if current {
                self.listings
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(ino, Listing { at: listed_at, entries: entries.clone() });
            }
            return Ok(entries);
        }
    }

    /// How old an answer about directory `dir` (its listing, or a name in it) may be: the
    /// TTL, and never from before this mount last changed the directory, so that a peer's
    /// answer from before a write here never hides the write.
    fn max_age(&self, dir: &str) -> Option<Duration> {
        let since = self.inodes.read().unwrap_or_else(|p| p.into_inner()).unchanged_for(dir);
        match (self.opts.metadata_ttl, since) {
            (Some(ttl), Some(since)) => Some(ttl.min(since)),
            (ttl, None) => ttl,
            (None, since) => since,
        }
    }

    /// How many changes this mount has made to the tree.
    fn changes(&self) -> u64 {
        self.inodes.read().unwrap_or_else(|p| p.into_inner()).changes
    }

    /// The inodes table, to change the tree at `paths`: the change is counted.
    fn changing(&self, paths: &[&str]) -> std::sync::RwLockWriteGuard<'_, Inodes> {
        let mut t = self.inodes.write().unwrap_or_else(|p| p.into_inner());
        t.touch(paths);
        t
    }

    /// The inodes of files being written here, whose nodes this mount knows better than the
    /// store.
    fn writing(&self) -> HashSet<u64> {
        let mut w: HashSet<u64> = self.writers.lock().unwrap_or_else(|p| p.into_inner()).keys().copied().collect();
        w.extend(self.closing.lock().unwrap_or_else(|p| p.into_inner()).keys());
        w
    }

    /// The staged copy of a file, whether handles still write it or its release is publishing
    /// it: what a rename must wait for and carry along.
    pub(crate) fn staged_of(&self, ino: u64) -> Option<Arc<tokio::sync::Mutex<Staged>>> {
        let writer = self.writers.lock().unwrap_or_else(|p| p.into_inner()).get(&ino).cloned();
        writer.or_else(|| {
            self.closing.lock().unwrap_or_else(|p| p.into_inner()).get(&ino).and_then(|v| v.last().cloned())
        })
    }

    /// The entries of a directory if a listing younger than the TTL has them.
    fn fresh_listing(&self, ino: u64) -> Option<Arc<Vec<(u64, Node)>>> {
        let l = self.listings.lock().unwrap_or_else(|p| p.into_inner());
        l.get(&ino)
            .filter(|hit| self.opts.metadata_ttl.is_none_or(|ttl| hit.at.elapsed() < ttl))
            .map(|h| h.entries.clone())
    }

    /// Takes every directory listing from a namespace snapshot at once, so no directory is
    /// listed from the store until its listing expires (never, for an immutable mount).
    pub fn seed(&self, tree: HashMap<String, Vec<Node>>) {
        let at = Instant::now();
        // Parents before children, so each directory's inode exists when its entries are added.
        let mut dirs: Vec<_> = tree.into_iter().collect();
        dirs.sort_by_key(|(d, _)| if d.is_empty() { 0 } else { d.matches('/').count() + 1 });
        for (dir, nodes) in dirs {
            let Some(dir_ino) = self.inodes.read().unwrap_or_else(|p| p.into_inner()).by_path.get(&dir).copied() else {
                continue;
            };
            let entries: Vec<(u64, Node)> =
                nodes.into_iter().map(|n| (self.ino_for(&join(&dir, &n.name), n.clone()), n)).collect();
            self.listings
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(dir_ino, Listing { at, entries: Arc::new(entries) });
        }
    }

    /// Looks a name up: in a fresh listing of its directory; else in the entry and negative
    /// caches; else by asking the namespace about that one name (a HEAD), which also
    /// revalidates a known file: a new ETag gives the inode the new version, so later opens
    /// never mix its bytes with the old one's. An answer that came while this mount changed the
    /// tree is asked for again, and is never cached over the change.
    pub async fn lookup(&self, parent: u64, name: &str) -> Result<Attr, FsError> {
        let mut tries = 0;
        loop {
            tries += 1;
            if let Some(answer) = self.lookup_once(parent, name, tries >= RACED_TRIES).await? {
                return Ok(answer);
            }
        }
    }

    /// One try of [`FsCore::lookup`]: `None` when the tree changed here while the store was
    /// asked, unless this is the `last` try.
    async fn lookup_once(&self, parent: u64, name: &str, last: bool) -> Result<Option<Attr>, FsError> {
        if let Some(entries) = self.fresh_listing(parent) {
            let (ino, listed) = entries.iter().find(|(_, n)| n.name == name).ok_or(FsError::NotFound)?;
            // The inode's node: it follows this mount's writes, the listing's does not.
            // Read in place: this is every lookup a data loader's workers make, and the inode
            // (its path) need not be copied for it.
            let t = self.inodes.read().unwrap_or_else(|p| p.into_inner());
            return Ok(Some(Self::attr(*ino, t.by_ino.get(ino).map_or(listed, |i| &i.node))));
        }
        let key = (parent, name.to_string());
        let now = Instant::now();
        if let Some((ino, until)) = self.entries.get(&key)
            && now < until
            && let Ok(i) = self.inode(ino)
        {
            return Ok(Some(Self::attr(ino, &i.node)));
        }
        if self.negative.get(&key).is_some_and(|until| now < until) {
            return Err(FsError::NotFound);
        }
        // Before the directory's path is read, as in `listing`.
        let seen = self.changes();
        let dir = self.inode(parent)?;
        if dir.node.kind != NodeKind::Dir {
            return Err(FsError::NotDir);
        }
        let path = join(&dir.path, name);
        let pending = self.pending.lock().unwrap_or_else(|p| p.into_inner()).get(&path).cloned();
        let (found, age) = match pending {
            Some(node) => (Some(node), Duration::ZERO),
            None => {
                let max_age = self.max_age(&dir.path);
                let max_missing = max_age.map_or(self.opts.negative_ttl, |m| m.min(self.opts.negative_ttl));
                self.ns
                    .stat_aged(&path, max_age, max_missing)
                    .await
                    .map_err(|source| FsError::List { dir: path.clone(), source })?
            }
        };
        let asked = Instant::now().checked_sub(age).unwrap_or_else(Instant::now);
        let writing = self.writing();
        // As in `listing`: checked, and cached, under the lock every change here counts under.
        let mut t = self.inodes.write().unwrap_or_else(|p| p.into_inner());
        let current = !t.changed_since(&dir.path, seen);
        if !current && !last {
            return Ok(None);
        }
        match found {
            Some(node) => {
                let (ino, node) = t.assign_answer(&path, &node, current, &writing);
                if current {
                    let until = asked + self.opts.metadata_ttl.unwrap_or(IMMUTABLE);
                    self.entries.insert(key, (ino, until));
                }
                Ok(Some(Self::attr(ino, &node)))
            }
            None if !current => match t.by_path.get(&path).and_then(|ino| t.by_ino.get(ino).map(|i| (*ino, i))) {
                Some((ino, i)) => Ok(Some(Self::attr(ino, &i.node))),
                None => Err(FsError::NotFound),
            },
            None => {
                self.negative.insert(key, asked + self.opts.negative_ttl);
                Err(FsError::NotFound)
            }
        }
    }

    /// Forgets what is cached about one name, after this mount changed it.
    fn forget_name(&self, parent: u64, name: &str) {
        let key = (parent, name.to_string());
        self.entries.invalidate(&key);
        self.negative.invalidate(&key);
    }

    pub fn getattr(&self, ino: u64) -> Result<Attr, FsError> {
        let i = self.inode(ino)?;
        Ok(Self::attr(ino, &i.node))
    }

    /// Entries for readdir, starting after `offset` entries; `.` and `..` come first.
    pub async fn readdir(&self, ino: u64) -> Result<Vec<(u64, NodeKind, String)>, FsError> {
        let entries = self.listing(ino).await?;
        let mut out = vec![(ino, NodeKind::Dir, ".".to_string()), (ino, NodeKind::Dir, "..".to_string())];
        out.extend(entries.iter().map(|(i, n)| (*i, n.kind, n.name.clone())));
        Ok(out)
    }

    /// Opens a file: for reading at the version the last listing saw, or for writing. Writing
    /// needs a new or empty file, a truncating open (`O_TRUNC`), or a file still being written.
    /// An existing object with content may be opened read-write (tools reopen files that way
    /// just to read them back), but a write through that handle is refused: S3 cannot change
    /// part of an object.
    pub fn open(&self, ino: u64, write: bool, truncate: bool) -> Result<u64, FsError> {
        let i = self.inode(ino)?;
        match i.node.kind {
            NodeKind::File => {}
            NodeKind::Dir => return Err(FsError::IsDir),
            // Devices and fifos are opened by the kernel itself; a symlink is followed first.
            _ => return Err(FsError::NotSupported("only regular files open through the mount")),
        }
        // The writer is looked up, made if needed, and the handle counted under one lock:
        // two opens at once must share one staged copy, and a release deciding that its
        // handle was the last must not miss an open joining that copy.
        let mut writers = self.writers.lock().unwrap_or_else(|p| p.into_inner());
        let (staged, in_place, started) = match (write, writers.get(&ino).cloned()) {
            (_, Some(s)) => (Some(s), false, false),
            (false, None) => (None, false, false),
            // An empty object has nothing to preserve, so writing it is a whole rewrite too; this
            // keeps create-close-reopen tools (fio, `touch` then write) working.
            (true, None) if truncate || i.node.size == 0 => {
                // A file unlinked or renamed over while open has no name to go up under: a
                // copy of its own would land over whatever has that name now.
                if !self.named(ino, &i.path) {
                    return Err(FsError::NotFound);
                }
                let s = self.new_staged(ino, &i.path)?;
                writers.insert(ino, s.clone());
                (Some(s), false, true)
            }
            (true, None) => (None, true, false),
        };
        let fh = self.new_handle(ino, i.path.clone(), i.node, staged, in_place);
        drop(writers);
        if started {
            self.note_staging(ino, &i.path);
        }
        Ok(fh)
    }

    /// An `O_TRUNC` open of a file that is still being written (or whose last handle is not
    /// yet released) starts its content again, as a truncate to zero would: the kernel sends no
    /// separate truncate for such an open (`FUSE_ATOMIC_O_TRUNC`). Call before [`FsCore::open`].
    pub async fn truncate_staged(&self, ino: u64) -> Result<(), FsError> {
        let Some(staged) = self.writers.lock().unwrap_or_else(|p| p.into_inner()).get(&ino).cloned() else {
            return Ok(());
        };
        let mut s = staged.lock().await;
        s.truncate(0).map_err(|source| FsError::Stage { path: s.target.clone(), source })?;
        drop(s);
        self.update_size(ino, 0);
        Ok(())
    }

    /// Every staged copy of a file, each once, in an order that does not change as copies move
    /// from the writers to the closing list, so that two callers holding them all take them
    /// alike. Read under both locks at once, in the order `release` takes them: a copy moving
    /// from one map to the other in between would be seen twice, and locked twice.
    fn copies_of(&self, ino: u64) -> Vec<Arc<tokio::sync::Mutex<Staged>>> {
        let writers = self.writers.lock().unwrap_or_else(|p| p.into_inner());
        let closing = self.closing.lock().unwrap_or_else(|p| p.into_inner());
        let mut out: Vec<Arc<tokio::sync::Mutex<Staged>>> = writers.get(&ino).cloned().into_iter().collect();
        for c in closing.get(&ino).into_iter().flatten() {
            if !out.iter().any(|o| Arc::ptr_eq(o, c)) {
                out.push(c.clone());
            }
        }
        out.sort_by_key(|c| Arc::as_ptr(c) as usize);
        out
    }

    /// Waits for the uploads under way of a file's copies, but for `but`. Nothing is held
    /// while waiting, so two renames crossing each other cannot wait on each other.
    async fn wait_uploads(&self, ino: u64, but: Option<&Arc<tokio::sync::Mutex<Staged>>>) {
        for c in self.copies_of(ino) {
            if but.is_none_or(|b| !Arc::ptr_eq(b, &c)) {
                drop(c.lock().await);
            }
        }
    }

    /// Whether the release of a copy of this file may still be uploading it.
    pub fn closing(&self, ino: u64) -> bool {
        self.closing.lock().unwrap_or_else(|p| p.into_inner()).contains_key(&ino)
    }

    /// Waits until no release of this file is uploading it, so that an open after a close sees
    /// the file as the store has it: until then it is a file without a version, which no read
    /// could fetch. Call before [`FsCore::open`] of a file [`FsCore::closing`] names.
    pub async fn settle_closing(&self, ino: u64) {
        // Polled, not locked: a release holds its copy while it caches the bytes it published,
        // which may take seconds for a checkpoint, and an open must not wait for that.
        // An open that finds a writer's copy joins it, and needs no version.
        while self.closing(ino) && !self.staging(ino) && self.inode(ino).is_ok_and(|i| i.node.version.is_empty()) {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Whether a file is being written here (a staged copy exists for it).
    pub fn staging(&self, ino: u64) -> bool {
        self.writers.lock().unwrap_or_else(|p| p.into_inner()).contains_key(&ino)
    }

    fn new_handle(
        &self,
        ino: u64,
        path: String,
        node: Node,
        staged: Option<Arc<tokio::sync::Mutex<Staged>>>,
        in_place: bool,
    ) -> u64 {
        let fetcher = self.ns.fetcher(&path, &node);
        let fh = self.next_fh.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let record = (staged.is_none() && self.journal.get().is_some()).then(|| Record::Handle {
            fh,
            ino,
            path: path.clone(),
            node: node.clone(),
            in_place,
        });
        let h = Arc::new(Handle {
            ino,
            path,
            node,
            fetcher,
            staged,
            in_place,
            ahead: Mutex::new(ReadAhead::default()),
            window: Mutex::new(Window::default()),
        });
        self.handles.lock().unwrap_or_else(|p| p.into_inner()).insert(fh, h);
        // After the insert: a compaction of the journal that missed the record saw the handle.
        if let (Some(r), Some(j)) = (record, self.journal.get()) {
            j.append(&r);
            self.compact_journal_if_due();
        }
        fh
    }

    /// Writes the journal whole again once its appends outgrow it, from the inode table and the
    /// read handles as they are. Both are held until it is written: an inode given out (which
    /// appends under the table's lock) or a handle opened meanwhile goes to the new file.
    fn compact_journal_if_due(&self) {
        let Some(j) = self.journal.get().filter(|j| j.wants_compacting()) else { return };
        let t = self.inodes.write().unwrap_or_else(|p| p.into_inner());
        let handles = self.handles.lock().unwrap_or_else(|p| p.into_inner());
        let state = Restored {
            inodes: t.by_ino.iter().map(|(ino, i)| (*ino, (i.path.clone(), i.node.clone()))).collect(),
            handles: handles
                .iter()
                .filter(|(_, h)| h.staged.is_none())
                .map(|(fh, h)| {
                    let r =
                        HandleRecord { ino: h.ino, path: h.path.clone(), node: h.node.clone(), in_place: h.in_place };
                    (*fh, r)
                })
                .collect(),
        };
        j.compact(&state);
    }

    /// Writes what this mount gives out to `journal` from now on, for a successor.
    pub fn journal_to(&self, journal: Journal) {
        let j = Arc::new(journal);
        self.inodes.write().unwrap_or_else(|p| p.into_inner()).journal = Some(j.clone());
        let _ = self.journal.set(j);
    }

    /// Takes on the inodes and read handles an earlier process gave the kernel. Call before
    /// the mount serves a request.
    pub fn restore(&self, state: &Restored) {
        let mut t = self.inodes.write().unwrap_or_else(|p| p.into_inner());
        for (ino, (path, node)) in &state.inodes {
            t.by_path.insert(path.clone(), *ino);
            if let Some(l) = node.posix.and_then(|p| p.link) {
                t.by_link.insert(l, *ino);
            }
            t.by_ino.insert(*ino, Inode { path: path.clone(), node: node.clone() });
            t.next = t.next.max(ino + 1);
        }
        drop(t);
        let mut handles = self.handles.lock().unwrap_or_else(|p| p.into_inner());
        for (fh, h) in &state.handles {
            let handle = Handle {
                ino: h.ino,
                path: h.path.clone(),
                node: h.node.clone(),
                fetcher: self.ns.fetcher(&h.path, &h.node),
                staged: None,
                in_place: h.in_place,
                ahead: Mutex::new(ReadAhead::default()),
                window: Mutex::new(Window::default()),
            };
            handles.insert(*fh, Arc::new(handle));
            self.next_fh.fetch_max(fh + 1, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// Whether a handle only reads a published version, and which: what may pass through.
    pub fn read_only_version(&self, fh: u64) -> Option<String> {
        let h = self.handle(fh).ok()?;
        (h.staged.is_none() && !h.in_place && !h.node.version.is_empty()).then(|| h.node.version.clone())
    }

    /// The hot tier's whole-file copy of what `fh` reads, opened, for the kernel to read
    /// directly. The open counts as an access to every chunk of the file, so the policy sees
    /// files read this way as hot. Without a copy, asks for one to be assembled if the file is
    /// all hot, for the next open.
    pub fn whole_file(&self, fh: u64) -> Option<std::fs::File> {
        let h = self.handle(fh).ok()?;
        if !self.opts.passthrough || h.staged.is_some() || h.in_place || h.node.version.is_empty() || h.node.size == 0 {
            return None;
        }
        let (whole, chunks) = crate::assemble::keys(self.ns.as_ref(), &h.path, &h.node);
        match self.cache.open_whole(&whole) {
            Some(f) => {
                self.cache.touch(&chunks);
                Some(f)
            }
            None => {
                self.keeper.request_whole(&h.path, &h.node);
                None
            }
        }
    }

    /// Whether `path` is still this inode's name.
    fn named(&self, ino: u64, path: &str) -> bool {
        self.inodes.read().unwrap_or_else(|p| p.into_inner()).by_path.get(path) == Some(&ino)
    }

    fn has_handles(&self, ino: u64) -> bool {
        self.handles.lock().unwrap_or_else(|p| p.into_inner()).values().any(|h| h.ino == ino)
    }

    /// Drops the inode of a file unlinked or renamed over while open, once its last handle
    /// is gone. A file that still has its name is left as it is, without a look at the handles.
    fn prune_if_nameless(&self, ino: u64) {
        let nameless = {
            let t = self.inodes.read().unwrap_or_else(|p| p.into_inner());
            t.by_ino.get(&ino).is_some_and(|i| t.by_path.get(&i.path) != Some(&ino))
        };
        if nameless && !self.has_handles(ino) {
            let mut t = self.inodes.write().unwrap_or_else(|p| p.into_inner());
            if t.by_ino.get(&ino).is_some_and(|i| t.by_path.get(&i.path) != Some(&ino)) {
                t.by_ino.remove(&ino);
            }
        }
    }

    fn handle(&self, fh: u64) -> Result<Arc<Handle>, FsError> {
        self.handles.lock().unwrap_or_else(|p| p.into_inner()).get(&fh).cloned().ok_or(FsError::BadHandle)
    }

    fn new_staged(&self, ino: u64, path: &str) -> Result<Arc<tokio::sync::Mutex<Staged>>, FsError> {
        let dir = self.opts.staging_dir.as_ref().ok_or(FsError::NotSupported("this mount is read-only"))?;
        let id = self.next_stage.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let staged = Staged::create(dir, id, path, self.ns.streaming().map(|s| s.part))
            .map_err(|source| FsError::Stage { path: path.to_string(), source })?;
        self.newest.lock().unwrap_or_else(|p| p.into_inner()).insert(ino, id);
        Ok(Arc::new(tokio::sync::Mutex::new(staged)))
    }

    /// Whether a newer staged copy of `ino` than `id` has started.
    fn superseded(&self, ino: u64, id: u64) -> bool {
        self.newest.lock().unwrap_or_else(|p| p.into_inner()).get(&ino).is_some_and(|n| *n != id)
    }

    /// Shows a file whose new content has started as an empty file not yet in the store.
    fn note_staging(&self, ino: u64, path: &str) {
        let name = path.rsplit('/').next().unwrap_or(path).to_string();
        let node =
            Node { name, kind: NodeKind::File, size: 0, version: String::new(), mtime: SystemTime::now(), posix: None };
        self.keeper.note_write(path, &node);
        self.pending.lock().unwrap_or_else(|p| p.into_inner()).insert(path.to_string(), node.clone());
        self.set_node(ino, path, node);
    }

    fn set_node(&self, ino: u64, path: &str, node: Node) {
        let mut t = self.changing(&[path]);
        t.by_path.insert(path.to_string(), ino);
        t.put(ino, Inode { path: path.to_string(), node });
    }

    fn ino_for(&self, path: &str, node: Node) -> u64 {
        self.inodes.write().unwrap_or_else(|p| p.into_inner()).assign(path, node)
    }

    fn forget_listing(&self, ino: u64) {
        self.listings.lock().unwrap_or_else(|p| p.into_inner()).remove(&ino);
    }

    fn parent_of(&self, path: &str) -> Option<u64> {
        let parent = path.rsplit_once('/').map(|(d, _)| d).unwrap_or("");
        self.inodes.read().unwrap_or_else(|p| p.into_inner()).by_path.get(parent).copied()
    }

    /// Creates a new, empty file and opens it for writing.
    pub async fn create(&self, parent: u64, name: &str) -> Result<(Attr, u64), FsError> {
        let dir = self.inode(parent)?;
        if dir.node.kind != NodeKind::Dir {
            return Err(FsError::NotDir);
        }
        let path = join(&dir.path, name);
        let node = Node {
            name: name.to_string(),
            kind: NodeKind::File,
            size: 0,
            version: String::new(),
            mtime: SystemTime::now(),
            posix: None,
        };
        let ino = self.changing(&[&path]).assign(&path, node.clone());
        let staged = self.new_staged(ino, &path)?;
        let fh = {
            let mut writers = self.writers.lock().unwrap_or_else(|p| p.into_inner());
            writers.insert(ino, staged.clone());
            self.new_handle(ino, path.clone(), node.clone(), Some(staged), false)
        };
        self.note_staging(ino, &path);
        self.forget_listing(parent);
        self.forget_name(parent, name);
        Ok((Self::attr(ino, &node), fh))
    }

    pub async fn write(&self, fh: u64, offset: u64, data: &[u8]) -> Result<u32, FsError> {
        let h = self.handle(fh)?;
        if h.in_place {
            return Err(FsError::NotSupported("an existing object can only be rewritten whole: open it with O_TRUNC"));
        }
        let staged = h.staged.as_ref().ok_or(FsError::NotWritable)?;
        let mut s = staged.lock().await;
        s.write_at(offset, data).map_err(|source| FsError::Stage { path: h.path.clone(), source })?;
        let parts = crate::streaming::pump(self.ns.as_ref(), &mut s).await;
        if parts > 0 {
            self.cache.metrics().fs_parts_while_writing.inc_by(parts);
        }
        let len = s.len;
        drop(s);
        self.update_size(h.ino, len);
        Ok(data.len() as u32)
    }

    fn update_size(&self, ino: u64, len: u64) {
        let mut t = self.inodes.write().unwrap_or_else(|p| p.into_inner());
        if let Some(i) = t.by_ino.get_mut(&ino) {
            i.node.size = len;
            i.node.mtime = SystemTime::now();
        }
    }

    /// Changes a file's size. Only a file being written can change; truncating an existing
    /// object to zero starts rewriting it.
    pub async fn set_size(&self, ino: u64, size: u64) -> Result<Attr, FsError> {
        let i = self.inode(ino)?;
        if i.node.kind == NodeKind::Dir {
            return Err(FsError::IsDir);
        }
        let existing = self.writers.lock().unwrap_or_else(|p| p.into_inner()).get(&ino).cloned();
        let staged = match existing {
            Some(s) => s,
            None if size == i.node.size => return Ok(Self::attr(ino, &i.node)),
            None => return Err(FsError::NotSupported("an existing object can only be rewritten whole")),
        };
        staged.lock().await.truncate(size).map_err(|source| FsError::Stage { path: i.path.clone(), source })?;
        self.update_size(ino, size);
        self.getattr(ino)
    }

    /// Uploads what a handle wrote, if anything is new. Returns once the object is durable in
    /// the store; an upload failure is this call's error, never silent.
    pub async fn flush(&self, fh: u64) -> Result<(), FsError> {
        let h = self.handle(fh)?;
        match &h.staged {
            Some(staged) => self.publish(h.ino, staged).await,
            None => Ok(()),
        }
    }

    async fn publish(&self, ino: u64, staged: &tokio::sync::Mutex<Staged>) -> Result<(), FsError> {
        // An older copy of this file may be going up from its release: this content, which
        // replaced it, must land after it, never under it.
        let older: Vec<_> = match self.closing.lock().unwrap_or_else(|p| p.into_inner()).get(&ino) {
            Some(v) => v.iter().take_while(|c| !std::ptr::eq(Arc::as_ptr(c), staged)).cloned().collect(),
            None => Vec::new(),
        };
        for o in older {
            drop(o.lock().await);
        }
        let mut s = staged.lock().await;
        // Unlinked while open: its content has no name to go up under.
        if !s.dirty || s.discarded {
            return Ok(());
        }
        if self.superseded(ino, s.id) {
            // A truncating open started the file again after this copy's last handle went;
            // what this copy held is what that open emptied.
            s.dirty = false;
            tracing::debug!(path = %s.target, "not uploaded: the file was opened with O_TRUNC since");
            return Ok(());
        }
        let path = s.target.clone();
        if let Some(code) = s.write_error {
            // Every flush, fsync and close says so again, as a local file system reports a
            // lost write to each.
            return Err(FsError::Stage { path, source: std::io::Error::from_raw_os_error(code) });
        }
        let outcome = match crate::streaming::finish(self.ns.as_ref(), &mut s).await {
            Some(Ok(node)) => Ok(node),
            Some(Err(StreamError::Store(source))) => Err(FsError::Publish { path: path.clone(), source }),
            Some(Err(StreamError::Stage(source))) => Err(FsError::Stage { path: path.clone(), source }),
            None => match s.seal() {
                Err(source) => Err(FsError::Stage { path: path.clone(), source }),
                Ok(()) => self
                    .ns
                    .publish(&path, s.data_path(), note_upload(s.manifest_path()))
                    .await
                    .map_err(|source| FsError::Publish { path: path.clone(), source }),
            },
        };
        let node = match outcome {
            Ok(node) => node,
            Err(e) => {
                s.failed = true;
                // Recorded now, not at release: a crash while the file is still open must not
                // let a restart upload what the writer was told had failed.
                if let Err(why) = s.mark_failed() {
                    tracing::warn!(path = %path, error = %why, "could not record the failed upload in the staging manifest");
                }
                return Err(e);
            }
        };
        s.dirty = false;
        s.mark_published();
        // Whatever stopped an upload while writing applied to that content; later writes may
        // stream again.
        s.streamable = true;
        self.published.lock().unwrap_or_else(|p| p.into_inner()).insert(ino, (s.id, node.version.clone()));
        self.pending.lock().unwrap_or_else(|p| p.into_inner()).remove(&path);
        // Before the staged copy is let go: a rename waiting on it must see the node this
        // publish made, or it would take the file for one not yet uploaded.
        self.set_node(ino, &path, node);
        drop(s);
        if let Some(parent) = self.parent_of(&path) {
            self.forget_listing(parent);
        }
        Ok(())
    }

    /// Releases a handle that has nothing to publish (a reader's) at once, without a trip to
    /// the runtime, which a data loader's workers would otherwise pay for every file they
    /// read. `false`, leaving the handle, when it is a writer's: [`FsCore::release`] then.
    /// `from_copy`: the kernel read the file from its whole-file copy, so there is none to make.
    pub fn release_reader(&self, fh: u64, from_copy: bool) -> bool {
        let h = {
            let mut handles = self.handles.lock().unwrap_or_else(|p| p.into_inner());
            match handles.get(&fh) {
                Some(h) if h.staged.is_some() => return false,
                Some(_) => handles.remove(&fh),
                None => return true,
            }
        };
        if let Some(j) = self.journal.get() {
            j.append(&Record::Closed { fh });
            self.compact_journal_if_due();
        }
        // A reader done with a file may have pulled all of it into the hot tier. Waking the
        // assembler only to find the copy there would cost a thread hop per file in every
        // epoch after the first.
        if let Some(h) = h {
            self.prune_if_nameless(h.ino);
            if !h.in_place && !from_copy {
                self.keeper.request_whole(&h.path, &h.node);
            }
        }
        true
    }

    /// Closes a handle. The last handle of a written file publishes it if a flush did not, and
    /// hands the staged bytes to the hot tier as the cached copy of the new object.
    pub async fn release(&self, fh: u64) -> Result<(), FsError> {
        if self.release_reader(fh, false) {
            return Ok(());
        }
        // Decided under the writers' lock, which every open that joins a staged copy holds:
        // once this is the copy's last handle, the copy leaves `writers` for `closing`, and an
        // open from now on starts a copy of its own instead of writing into one being
        // published and then dropped.
        let (h, staged) = {
            let mut writers = self.writers.lock().unwrap_or_else(|p| p.into_inner());
            let mut handles = self.handles.lock().unwrap_or_else(|p| p.into_inner());
            let Some(h) = handles.remove(&fh) else { return Ok(()) };
            let Some(staged) = h.staged.clone() else { return Ok(()) };
            if handles.values().any(|o| o.staged.as_ref().is_some_and(|s| Arc::ptr_eq(s, &staged))) {
                return Ok(());
            }
            drop(handles);
            if writers.get(&h.ino).is_some_and(|w| Arc::ptr_eq(w, &staged)) {
                writers.remove(&h.ino);
            }
            self.closing.lock().unwrap_or_else(|p| p.into_inner()).entry(h.ino).or_default().push(staged.clone());
            (h, staged)
        };
        let released = self.release_last(&h, &staged).await;
        let writers = self.writers.lock().unwrap_or_else(|p| p.into_inner());
        let mut closing = self.closing.lock().unwrap_or_else(|p| p.into_inner());
        let mut others = false;
        if let Some(v) = closing.get_mut(&h.ino) {
            v.retain(|c| !Arc::ptr_eq(c, &staged));
            others = !v.is_empty();
            if !others {
                closing.remove(&h.ino);
            }
        }
        // Kept while an older copy may still reach its upload (it must find itself
        // superseded) or a writer's copy is the newest; gone with the file's last copy.
        let mut newest = self.newest.lock().unwrap_or_else(|p| p.into_inner());
        if !others && !writers.contains_key(&h.ino) {
            newest.remove(&h.ino);
        }
        drop((newest, closing, writers));
        self.prune_if_nameless(h.ino);
        released
    }

    /// The release of a staged copy's last handle: publish it if a flush did not, then keep
    /// its bytes as the cached copy of the new object.
    async fn release_last(&self, h: &Handle, staged: &tokio::sync::Mutex<Staged>) -> Result<(), FsError> {
        {
            let mut s = staged.lock().await;
            if s.discarded {
                // Unlinked, or renamed over, while open: nothing to publish, keep or report, and
                // its old name, if anyone has it now, is another file's, not to be shown as the
                // store has it.
                return Ok(());
            }
            if let Some(code) = s.write_error.filter(|_| s.dirty) {
                // Known to be incomplete, and likely filling a disk that is full: dropped. The
                // name then shows what the store holds, the object as it was or nothing.
                let (why, path) = (std::io::Error::from_raw_os_error(code), s.target.clone());
                let superseded = self.superseded(h.ino, s.id);
                s.discard();
                drop(s);
                if !superseded {
                    self.show_the_stores_version(h.ino, &path).await;
                }
                tracing::warn!(path = %path, error = %why, "not uploaded: a write to it failed; its staged bytes are dropped");
                return Ok(());
            }
        }
        if let Some(kept) = self.keep_failed(staged).await {
            // The writer was told; the name shows what the store holds (the object as it was,
            // or nothing), not a file without a version that no read could fetch.
            let (path, id) = {
                let s = staged.lock().await;
                (s.target.clone(), s.id)
            };
            if kept.is_ok() && !self.superseded(h.ino, id) {
                self.show_the_stores_version(h.ino, &path).await;
            }
            return kept;
        }
        let published = self.publish(h.ino, staged).await;
        if published.is_ok() {
            // In the store, its manifest is already gone (`Staged::mark_published`): a restart
            // will not upload it again, under what may by then be a stale name.
            // Checkpoint writers rename the file right after closing it. Waiting for that puts
            // the cached copy in under the final name at once, instead of writing it under the
            // temp name and then copying it to the new one.
            tokio::time::sleep(RENAME_SETTLE).await;
            let deadline = Instant::now() + Duration::from_secs(60);
            while self.renaming.lock().unwrap_or_else(|p| p.into_inner()).contains(&h.ino) && Instant::now() < deadline
            {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            let mut s = staged.lock().await;
            self.keep_as_cache(&s, h.ino).await;
            s.discard();
        }
        published
    }

    /// Shows a name as the store has it, once this mount's content for it is not going up:
    /// the object as it was before, or nothing.
    async fn show_the_stores_version(&self, ino: u64, path: &str) {
        self.pending.lock().unwrap_or_else(|p| p.into_inner()).remove(path);
        // Counted before the caches are forgotten: a listing that took the pending file must
        // not be cached after the forgetting.
        drop(self.changing(&[path]));
        if let Some(parent) = self.parent_of(path) {
            self.forget_listing(parent);
            self.forget_name(parent, path.rsplit('/').next().unwrap_or(path));
        }
        match self.ns.stat(path).await {
            Ok(Some(node)) => self.set_node(ino, path, node),
            // Gone from the store too (or not known now): the next lookup asks again.
            _ => {
                self.changing(&[path]).by_path.remove(path);
            }
        }
    }

    /// A file whose last upload failed, with the writer told so by fsync or close, is not
    /// uploaded again when its last handle goes: the kernel sends that release after close has
    /// returned, so an upload now would land behind the writer's back, perhaps over an object
    /// it wrote again since. Its staged copy is kept, and reported, for the operator. `None`
    /// when the release should publish as usual.
    async fn keep_failed(&self, staged: &tokio::sync::Mutex<Staged>) -> Option<Result<(), FsError>> {
        let s = staged.lock().await;
        if !(s.dirty && s.failed) {
            return None;
        }
        let path = s.target.clone();
        if let Err(source) = s.mark_failed() {
            return Some(Err(FsError::Stage { path, source }));
        }
        tracing::warn!(
            path = %path,
            kept = %s.data_path().display(),
            "not uploaded at release: its upload failed and the writer was told; the staged copy is kept"
        );
        Some(Ok(()))
    }

    /// Makes a published file's staged copy the whole-file copy that passthrough opens read,
    /// then reads its bytes into the cache under the new object's chunk keys, so the
    /// checkpoint just written is hot for the next restart, and pins it as its directory's
    /// newest.
    async fn keep_as_cache(&self, s: &Staged, ino: u64) {
        let _order = self.keeper.order.lock().await;
        let Ok(i) = self.inode(ino) else { return };
        // Rewritten since, or replaced: these bytes are not that content.
        {
            let mut published = self.published.lock().unwrap_or_else(|p| p.into_inner());
            match published.get(&ino) {
                Some((id, version)) if *id == s.id && *version == i.node.version => {
                    published.remove(&ino);
                }
                Some((id, _)) if *id == s.id => {
                    published.remove(&ino);
                    return;
                }
                _ => return,
            }
        }
        if i.node.version.is_empty() || i.node.size != s.len {
            return;
        }
        // The copy first: moving the staged file into the hot tier takes a rename, where the
        // chunks take a read and a write of every byte, so a restart soon after the checkpoint
        // reads it at local speed seconds sooner. The chunks are read from the staged file's
        // open descriptor, which the move leaves valid.
        let adopted = match &self.keeper.assemble {
            None => false,
            Some(_) => {
                let (whole, _) = crate::assemble::keys(self.ns.as_ref(), &i.path, &i.node);
                self.cache.adopt_whole(whole, s.data_path().to_path_buf()).await.unwrap_or_else(|e| {
                    tracing::debug!(path = %i.path, error = %e, "staged copy not taken as the whole-file copy");
                    false
                })
            }
        };
        let chunk = self.ns.chunk_size();
        let mut index = 0;
        while index * chunk < s.len {
            let Ok(bytes) = s.read_at(index * chunk, chunk as usize) else { return };
            let key = self.ns.chunk_key(&i.path, &i.node, index);
            if self.cache.put(key, Bytes::from(bytes), strata_tiering::TierKind::Hot).await.is_err() {
                return;
            }
            index += 1;
        }
        self.keeper.keep_newest(&i.path, &i.node, s.created).await;
        if !adopted {
            self.keeper.request_whole(&i.path, &i.node);
        }
    }

    pub async fn unlink(&self, parent: u64, name: &str) -> Result<(), FsError> {
        let attr = self.lookup(parent, name).await?;
        if attr.kind == NodeKind::Dir {
            return Err(FsError::IsDir);
        }
        let path = self.inode(attr.ino)?.path;
        // Every staged copy of the file, held: one still going up from its release is waited
        // for, so the delete below comes after its upload; none is dropped before the delete
        // has gone through, so a failed one leaves the file as it was.
        let copies = self.copies_of(attr.ino);
        let mut held = Vec::with_capacity(copies.len());
        for c in &copies {
            held.push(c.lock().await);
        }
        // Always asked of the store, even for a file being written that was never uploaded:
        // an `O_TRUNC` rewrite of an object looks just like a new file until its close, and
        // skipping the delete would bring the old object back at the next lookup. A key the
        // store never had is a delete of nothing.
        self.ns.remove(&path).await.map_err(|source| FsError::Namespace {
            what: "deleting",
            path: path.clone(),
            source,
        })?;
        for s in held.iter_mut() {
            s.discard();
        }
        drop(held);
        {
            let mut w = self.writers.lock().unwrap_or_else(|p| p.into_inner());
            if w.get(&attr.ino).is_some_and(|c| copies.iter().any(|x| Arc::ptr_eq(x, c))) {
                w.remove(&attr.ino);
            }
        }
        self.pending.lock().unwrap_or_else(|p| p.into_inner()).remove(&path);
        self.published.lock().unwrap_or_else(|p| p.into_inner()).remove(&attr.ino);
        let open = self.has_handles(attr.ino);
        let mut t = self.changing(&[&path]);
        t.by_path.remove(&path);
        // Open handles still ask for its attributes (`fstat`, and the kernel before reading
        // past a size it no longer trusts): kept, nameless, until the last one goes.
        if !open {
            t.by_ino.remove(&attr.ino);
        }
        drop(t);
        self.forget_listing(parent);
        self.forget_name(parent, name);
        Ok(())
    }

    pub async fn mkdir(&self, parent: u64, name: &str) -> Result<Attr, FsError> {
        if !self.writable() {
            return Err(FsError::NotSupported("this mount is read-only"));
        }
        if self.lookup(parent, name).await.is_ok() {
            return Err(FsError::Exists);
        }
        let dir = self.inode(parent)?;
        let path = join(&dir.path, name);
        let node = Node {
            name: name.to_string(),
            kind: NodeKind::Dir,
            size: 0,
            version: String::new(),
            mtime: SystemTime::now(),
            posix: None,
        };
        // S3 has no directories: this one lives here until files are written under it.
        self.pending.lock().unwrap_or_else(|p| p.into_inner()).insert(path.clone(), node.clone());
        let ino = self.changing(&[&path]).assign(&path, node.clone());
        self.forget_listing(parent);
        self.forget_name(parent, name);
        Ok(Self::attr(ino, &node))
    }

    pub async fn rmdir(&self, parent: u64, name: &str) -> Result<(), FsError> {
        let attr = self.lookup(parent, name).await?;
        if attr.kind != NodeKind::Dir {
            return Err(FsError::NotDir);
        }
        self.forget_listing(attr.ino);
        if !self.listing(attr.ino).await?.is_empty() {
            return Err(FsError::NotEmpty);
        }
        let path = self.inode(attr.ino)?.path;
        self.pending.lock().unwrap_or_else(|p| p.into_inner()).remove(&path);
        let mut t = self.changing(&[&path]);
        t.by_path.remove(&path);
        t.by_ino.remove(&attr.ino);
        drop(t);
        self.forget_listing(parent);
        self.forget_name(parent, name);
        self.listings.lock().unwrap_or_else(|p| p.into_inner()).remove(&attr.ino);
        Ok(())
    }

    /// Renames a file or a directory. A file still being written simply gets a new target; a
    /// published one is copied server-side and the source deleted. The destination is replaced.
    pub async fn rename(&self, parent: u64, name: &str, new_parent: u64, new_name: &str) -> Result<(), FsError> {
        let src = self.lookup(parent, name).await?;
        if src.kind == NodeKind::Dir {
            return self.rename_dir(parent, name, src.ino, new_parent, new_name).await;
        }
        let _renaming = Renaming::start(&self.renaming, src.ino);
        let dst_dir = self.inode(new_parent)?;
        if dst_dir.node.kind != NodeKind::Dir {
            return Err(FsError::NotDir);
        }
        let to = join(&dst_dir.path, new_name);
        let replaced = self.lookup(new_parent, new_name).await.ok();
        if replaced.as_ref().is_some_and(|e| e.kind == NodeKind::Dir) {
            return Err(FsError::IsDir);
        }
        let writer = self.staged_of(src.ino);
        // Older copies of the file still going up from their releases land first: after the
        // rename they would bring back the old name.
        self.wait_uploads(src.ino, writer.as_ref()).await;
        // Held to the end of the rename: a flush of this file waits, rather than uploading under
        // the old name between the copy and the delete, and a flush that was running has set
        // the node it made before the file is read below. The copies of the file the rename
        // replaces are held too, so that none of them, going up from a release or a flush,
        // lands over the new name's content. Taken in inode order, as a directory rename takes
        // its files', so that renames crossing each other cannot each hold what the other waits for.
        let replaced_copies = replaced.as_ref().filter(|r| r.ino != src.ino).map(|r| (r.ino, self.copies_of(r.ino)));
        let replaced_first = replaced_copies.as_ref().is_some_and(|(ino, _)| *ino < src.ino);
        let mut replaced_held = Vec::new();
        let lock_replaced = async |held: &mut Vec<tokio::sync::OwnedMutexGuard<Staged>>| {
            for c in replaced_copies.iter().flat_map(|(_, v)| v) {
                held.push(c.clone().lock_owned().await);
            }
        };
        if replaced_first {
            lock_replaced(&mut replaced_held).await;
        }
        let mut staged = match &writer {
            Some(w) => Some(w.lock().await),
            None => None,
        };
        if !replaced_first {
            lock_replaced(&mut replaced_held).await;
        }
        let from = self.inode(src.ino)?;
        let unpublished = staged.as_ref().is_some_and(|s| s.dirty || from.node.version.is_empty());
        let mut rekey = None;
        let node = match staged.as_mut() {
            Some(s) if unpublished => {
                // Not uploaded yet: the upload simply goes to the new name. An older object under
                // the old name (a rewrite in progress) goes away with the name.
                // The old name's object first (a key never there is a delete of nothing): if it
                // cannot go, the rename fails whole, and the name keeps its file and its object.
                self.ns.remove(&from.path).await.map_err(|source| FsError::Namespace {
                    what: "deleting",
                    path: from.path.clone(),
                    source,
                })?;
                s.retarget(&to).map_err(|source| FsError::Stage { path: to.clone(), source })?;
                let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
                let mut n = pending.remove(&from.path).unwrap_or(from.node.clone());
                n.name = new_name.to_string();
                pending.insert(to.clone(), n.clone());
                n
            }
            s => {
                let mut n = self.ns.rename(&from.path, &from.node, &to).await.map_err(|source| FsError::Namespace {
                    what: "renaming",
                    path: from.path.clone(),
                    source,
                })?;
                // Still open after an fsync: later writes and the close go to the new name.
                if let Some(s) = s {
                    s.retarget(&to).map_err(|source| FsError::Stage { path: to.clone(), source })?;
                }
                let mut published = self.published.lock().unwrap_or_else(|p| p.into_inner());
                if let Some((_, version)) = published.get_mut(&src.ino).filter(|(_, v)| *v == from.node.version) {
                    *version = n.version.clone();
                }
                drop(published);
                // A file not yet uploaded that had the name (one still being written) is gone.
                self.pending.lock().unwrap_or_else(|p| p.into_inner()).remove(&to);
                n.name = new_name.to_string();
                rekey = Some(n.clone());
                n
            }
        };
        let displaced_open = replaced.as_ref().is_some_and(|r| r.ino != src.ino && self.has_handles(r.ino));
        {
            let mut t = self.changing(&[&from.path, &to]);
            t.by_path.remove(&from.path);
            if let Some(old) = t.by_path.insert(to.clone(), src.ino)
                && old != src.ino
                && !displaced_open
            {
                t.by_ino.remove(&old);
            }
            t.put(src.ino, Inode { path: to.clone(), node });
        }
        drop(staged);
        // A file the rename replaced that is still open for writing is now nameless, as after
        // an unlink: its writer's close must not upload over the file renamed into its place.
        // Its copies are dropped before they are let go, those held above and any an open made
        // while the rename ran; none can be made from now on (`open` wants a name).
        if let Some(old) = replaced.filter(|r| r.ino != src.ino) {
            loop {
                let made: Vec<_> = self
                    .copies_of(old.ino)
                    .into_iter()
                    .filter(|c| !replaced_held.iter().any(|h| Arc::ptr_eq(tokio::sync::OwnedMutexGuard::mutex(h), c)))
                    .collect();
                if made.is_empty() {
                    break;
                }
                for c in made {
                    replaced_held.push(c.lock_owned().await);
                }
            }
            for s in replaced_held.iter_mut() {
                s.discard();
            }
            self.writers.lock().unwrap_or_else(|p| p.into_inner()).remove(&old.ino);
            drop(replaced_held);
            self.published.lock().unwrap_or_else(|p| p.into_inner()).remove(&old.ino);
        }
        let to_path = to;
        self.forget_listing(parent);
        self.forget_listing(new_parent);
        self.forget_name(parent, name);
        self.forget_name(new_parent, new_name);
        if let Some(new) = rekey {
            // In the background: the rename is done, and keeping the file hot under its new
            // name is local copying that the caller need not wait for.
            let (keeper, from_path, old) = (self.keeper.clone(), from.path.clone(), from.node.clone());
            tokio::spawn(async move { keeper.rekey_cached(&from_path, &old, &to_path, &new).await });
        }
        Ok(())
    }

    /// Starts loading chunk `i` of what `h` reads, through the cache, as a task of its own so
    /// it goes on while nobody waits on it. A demand load holds a share of the memory budget
    /// while it fetches.
    fn load(&self, h: &Handle, i: u64, budget: Option<Arc<tokio::sync::Semaphore>>) -> ChunkFuture {
        use futures::FutureExt;
        let key = self.ns.chunk_key(&h.path, &h.node, i);
        let (cache, fetcher) = (self.cache.clone(), h.fetcher.clone());
        let task = tokio::spawn(async move {
            let _permit = match budget {
                Some(b) => Some(b.acquire_owned().await),
                None => None,
            };
            cache.get(&key, fetcher, Default::default()).await.map_err(Arc::new)
        });
        async move { task.await.unwrap_or_else(|e| Err(Arc::new(CacheError::Task(e.to_string())))) }.boxed().shared()
    }

    /// Loads chunks ahead of a sequential reader into its window, each under a share of the
    /// read-ahead half of the memory budget. When that is used up, the budget held by readers
    /// that have gone idle is taken back once; what still does not fit is not read ahead.
    fn read_ahead(&self, h: &Handle, range: std::ops::Range<u64>) {
        let mut reclaimed = false;
        for i in range {
            if h.window.lock().unwrap_or_else(|p| p.into_inner()).contains(i) {
                continue;
            }
            let permit = match self.ahead.clone().try_acquire_owned() {
                Ok(p) => p,
                Err(_) if reclaimed => return,
                Err(_) => {
                    reclaimed = true;
                    self.reclaim_idle_read_ahead(h);
                    let Ok(p) = self.ahead.clone().try_acquire_owned() else { return };
                    p
                }
            };
            let chunk = self.load(h, i, None);
            h.window.lock().unwrap_or_else(|p| p.into_inner()).ahead(i, chunk, permit);
        }
    }

    fn reclaim_idle_read_ahead(&self, reader: &Handle) {
        let handles: Vec<Arc<Handle>> =
            self.handles.lock().unwrap_or_else(|p| p.into_inner()).values().cloned().collect();
        for other in handles {
            if !std::ptr::eq(other.as_ref(), reader) {
                other.window.lock().unwrap_or_else(|p| p.into_inner()).release_if_idle(IDLE_READER);
            }
        }
    }

    /// Reads `size` bytes at `offset` of an open file, loading only the chunks it touches, all
    /// of them at once, and reading ahead of a sequential reader.
    pub async fn read(&self, fh: u64, offset: u64, size: u32) -> Result<Bytes, FsError> {
        let h = self.handle(fh)?;
        if let Some(staged) = &h.staged {
            let s = staged.lock().await;
            let buf =
                s.read_at(offset, size as usize).map_err(|source| FsError::Stage { path: h.path.clone(), source })?;
            return Ok(Bytes::from(buf));
        }
        let file_size = h.node.size;
        if offset >= file_size || size == 0 {
            return Ok(Bytes::new());
        }
        let end = (offset + size as u64).min(file_size);
        let chunk = self.ns.chunk_size();
        let (first, last) = (offset / chunk, (end - 1) / chunk);
        let (ahead, sequential) = {
            let mut ra = h.ahead.lock().unwrap_or_else(|p| p.into_inner());
            let ahead = ra.on_read(offset, end, chunk, file_size, self.opts.max_read_ahead);
            (ahead, ra.sequential())
        };
        if !sequential && {
            let w = h.window.lock().unwrap_or_else(|p| p.into_inner());
            !(first..=last).all(|i| w.contains(i))
        } {
            return self.read_pieces(&h, offset, end).await;
        }
        let loads: Vec<(u64, ChunkFuture)> = {
            let mut w = h.window.lock().unwrap_or_else(|p| p.into_inner());
            w.advance(first, last, self.opts.max_read_ahead.div_ceil(chunk) + 1);
            (first..=last).map(|i| (i, w.demand(i, || self.load(&h, i, Some(self.demand.clone()))))).collect()
        };
        // After the demand loads, so they are queued first.
        if let Some(range) = ahead {
            self.read_ahead(&h, range);
        }
        let reads = loads.into_iter().map(|(i, load)| async move { load.await.map(|b| (i, b)) });
        let chunks = futures::future::try_join_all(reads)
            .await
            .map_err(|source| FsError::Read { path: h.path.clone(), source })?;
        if chunks.len() == 1 {
            let (i, b) = &chunks[0];
            let start = ((offset - i * chunk) as usize).min(b.len());
            let stop = (start + (end - offset) as usize).min(b.len());
            return Ok(b.slice(start..stop));
        }
        let mut out = BytesMut::with_capacity((end - offset) as usize);
        for (i, b) in chunks {
            let base = i * chunk;
            let to = ((end - base) as usize).min(b.len());
            let from = (offset.saturating_sub(base) as usize).min(to);
            out.extend_from_slice(&b[from..to]);
        }
        Ok(out.freeze())
    }
}

impl FsCore {
    /// A read of a reader that jumps about: just the bytes asked for of each chunk, which a
    /// chunk in a local tier gives by loading only the pieces they fall in. Holding its whole
    /// chunks in the window, as for a sequential reader, would cost a load of each chunk for
    /// every read, most of it never used.
    async fn read_pieces(&self, h: &Handle, offset: u64, end: u64) -> Result<Bytes, FsError> {
        let chunk = self.ns.chunk_size();
        let reads = (offset / chunk..=(end - 1) / chunk).map(|i| {
            let base = i * chunk;
            let range = offset.max(base) - base..end.min(base + chunk) - base;
            let key = self.ns.chunk_key(&h.path, &h.node, i);
            let (cache, fetcher, budget) = (self.cache.clone(), h.fetcher.clone(), self.demand.clone());
            async move {
                // A miss fetches the whole chunk: it holds a share of the budget meanwhile.
                let _permit = budget.acquire_owned().await;
                cache.get_range(&key, fetcher, range).await
            }
        });
        let parts = futures::future::try_join_all(reads)
            .await
            .map_err(|source| FsError::Read { path: h.path.clone(), source: Arc::new(source) })?;
        if parts.len() == 1 {
            return Ok(parts.into_iter().next().expect("one part"));
        }
        let mut out = BytesMut::with_capacity((end - offset) as usize);
        parts.iter().for_each(|p| out.extend_from_slice(p));
        Ok(out.freeze())
    }
}

#[cfg(test)]
mod tests_support {
    use super::*;
    use crate::objects::ObjectNamespace;
    use strata_tiering::source::{ColdConfig, ColdKind, ObjectSource};
    use strata_tiering::units::ByteSize;
    use strata_tiering::{CacheConfig, Policy, TierConfig};

    /// Makes the cold store of [`setup`] refuse every object under the directory `rel`, until
    /// [`unblock_uploads`]: a file where the directory was refuses them, even to root.
    pub fn block_uploads(dir: &std::path::Path, rel: &str) {
        let (real, away) = (dir.join("cold").join(rel), dir.join("cold").join(format!("{rel}.away")));
        std::fs::rename(&real, &away).unwrap();
        std::fs::write(&real, b"not a directory").unwrap();
    }

    pub fn unblock_uploads(dir: &std::path::Path, rel: &str) {
        let (real, away) = (dir.join("cold").join(rel), dir.join("cold").join(format!("{rel}.away")));
        std::fs::remove_file(&real).unwrap();
        std::fs::rename(&away, &real).unwrap();
    }

    /// What the cold store of [`setup`] holds at `rel`.
    pub fn cold(dir: &std::path::Path, rel: &str) -> Option<Vec<u8>> {
        std::fs::read(dir.join("cold").join(rel)).ok()
    }

    pub fn setup(dir: &std::path::Path) -> FsCore {
        setup_with_parts(dir, 8 << 20)
    }

    /// As [`setup`], with uploads in parts of `part_size` bytes, two in flight.
    pub fn setup_with_parts(dir: &std::path::Path, part_size: usize) -> FsCore {
        setup_with_part_limit(dir, part_size, strata_tiering::source::MAX_PARTS)
    }

    /// As `setup_with_parts`, with a store that takes at most `max_parts` parts per upload.
    pub fn setup_with_part_limit(dir: &std::path::Path, part_size: usize, max_parts: u64) -> FsCore {
        setup_wrapped(dir, part_size, max_parts, None, |ns| ns)
    }

    /// As [`setup`], with metadata trusted for `ttl` (forever for `None`) and the store's
    /// namespace seen through `wrap`.
    pub fn setup_wrapped(
        dir: &std::path::Path,
        part_size: usize,
        max_parts: u64,
        ttl: Option<Duration>,
        wrap: impl FnOnce(Arc<dyn Namespace>) -> Arc<dyn Namespace>,
    ) -> FsCore {
        let cold = dir.join("cold");
        std::fs::create_dir_all(cold.join("d/e")).unwrap();
        let big: Vec<u8> = (0..20_000u32).map(|i| (i % 251) as u8).collect();
        std::fs::write(cold.join("d/big.bin"), &big).unwrap();
        std::fs::write(cold.join("d/e/small"), b"hi").unwrap();
        let cfg =
            ColdConfig { kind: ColdKind::Local, path: Some(cold), chunk_size: ByteSize(4096), ..ColdConfig::default() };
        let source = ObjectSource::new(&cfg, dir).unwrap().with_max_parts(max_parts);
        let cache = TieredCache::open(CacheConfig {
            hot: TierConfig::new(dir.join("hot"), 1 << 20),
            warm: None,
            state_dir: dir.join("state"),
            policy: Policy::default(),
        })
        .unwrap();
        FsCore::new(
            wrap(Arc::new(ObjectNamespace::new(source, part_size, 2))),
            cache,
            FsOptions {
                metadata_ttl: ttl,
                negative_ttl: Duration::from_secs(5),
                staging_dir: Some(dir.join("staging")),
                memory_budget: 64 << 20,
                max_read_ahead: 16 << 20,
                passthrough: true,
                keep_newest_hot: true,
                checkpoint_window: Duration::from_secs(600),
            },
        )
    }
}

#[cfg(test)]
mod tests {
    use super::tests_support::setup;
    use super::*;

    #[tokio::test]
    async fn tree_and_reads_across_chunks() {
        let dir = tempfile::tempdir().unwrap();
        let fs = setup(dir.path());
        let d = fs.lookup(ROOT, "d").await.unwrap();
        assert_eq!(d.kind, NodeKind::Dir);
        let names: Vec<String> = fs.readdir(d.ino).await.unwrap().into_iter().map(|e| e.2).collect();
        assert_eq!(names, [".", "..", "e", "big.bin"]);
        let big = fs.lookup(d.ino, "big.bin").await.unwrap();
        assert_eq!(big.size, 20_000);
        assert_eq!(fs.lookup(d.ino, "big.bin").await.unwrap().ino, big.ino, "inode numbers are stable");
        let fh = fs.open(big.ino, false, false).unwrap();
        let want: Vec<u8> = (0..20_000u32).map(|i| (i % 251) as u8).collect();
        // Within one chunk, across three chunks, and past the end.
        assert_eq!(fs.read(fh, 10, 100).await.unwrap(), want[10..110]);
        assert_eq!(fs.read(fh, 4000, 9000).await.unwrap(), want[4000..13000]);
        assert_eq!(fs.read(fh, 19_990, 4096).await.unwrap(), want[19_990..]);
        assert!(fs.read(fh, 20_000, 10).await.unwrap().is_empty());
        fs.release(fh).await.unwrap();
        assert!(matches!(fs.read(fh, 0, 1).await, Err(FsError::BadHandle)));
        assert!(matches!(fs.lookup(d.ino, "nope").await, Err(FsError::NotFound)));
        assert!(matches!(fs.open(d.ino, false, false), Err(FsError::IsDir)));
        let rw = fs.open(big.ino, true, false).unwrap();
        assert_eq!(fs.read(rw, 0, 3).await.unwrap(), &[0u8, 1, 2][..], "a read-write open of an object reads it");
        assert!(matches!(fs.write(rw, 0, b"x").await, Err(FsError::NotSupported(_))));
        fs.release(rw).await.unwrap();
        assert!(matches!(fs.readdir(big.ino).await, Err(FsError::NotDir)));
    }

    /// Reads a file whole through a handle of its own and closes it, which asks for its
    /// whole-file copy; returns the copy's key.
    async fn read_whole(fs: &FsCore, dir: u64, name: &str) -> strata_tiering::ChunkKey {
        let a = fs.lookup(dir, name).await.unwrap();
        let fh = fs.open(a.ino, false, false).unwrap();
        assert_eq!(fs.read(fh, 0, a.size as u32).await.unwrap().len() as u64, a.size);
        let h = fs.handle(fh).unwrap();
        let (whole, _) = crate::assemble::keys(fs.ns.as_ref(), &h.path, &h.node);
        assert!(fs.release_reader(fh, false));
        whole
    }

    async fn until_copied(fs: &FsCore, whole: &strata_tiering::ChunkKey) {
        for _ in 0..500 {
            if fs.cache.location(whole).is_some() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("no whole-file copy of {whole} after 5 s");
    }

    /// An open served from a file's whole-file copy counts one access to it, so the policy
    /// ranks such files as it ranks others. The close asks the assembler for the copy again,
    /// and its check that the copy is there must not count a second one.
    #[tokio::test]
    async fn each_open_of_a_whole_file_copy_counts_one_access() {
        let dir = tempfile::tempdir().unwrap();
        let fs = setup(dir.path());
        let d = fs.lookup(ROOT, "d").await.unwrap();
        let big = read_whole(&fs, d.ino, "big.bin").await;
        until_copied(&fs, &big).await;
        let before = fs.cache.hits(&big).unwrap();
        let ino = fs.lookup(d.ino, "big.bin").await.unwrap().ino;
        for _ in 0..3 {
            let fh = fs.open(ino, false, false).unwrap();
            assert!(fs.whole_file(fh).is_some(), "the copy was not handed out");
            assert!(fs.release_reader(fh, false));
        }
        // The assembler takes requests in order: once a file closed after those three has its
        // copy, the three closes have been seen to.
        let e = fs.lookup(d.ino, "e").await.unwrap();
        let small = read_whole(&fs, e.ino, "small").await;
        until_copied(&fs, &small).await;
        assert_eq!(fs.cache.hits(&big).unwrap(), before + 3);
    }
}

#[cfg(test)]
mod write_tests {
    use super::tests_support::{block_uploads, cold, setup, unblock_uploads};
    use super::*;

    #[tokio::test]
    async fn mkdir_then_rmdir() {
        let dir = tempfile::tempdir().unwrap();
        let fs = setup(dir.path());
        let a = fs.mkdir(ROOT, "d2").await.unwrap();
        assert_eq!(fs.lookup(ROOT, "d2").await.unwrap().ino, a.ino);
        fs.rmdir(ROOT, "d2").await.unwrap();
        assert!(matches!(fs.lookup(ROOT, "d2").await, Err(FsError::NotFound)));
        assert!(matches!(fs.rmdir(ROOT, "d").await, Err(FsError::NotEmpty)));
    }

    /// The directory `d/e` of the test tree.
    async fn dir_e(fs: &FsCore) -> Attr {
        let d = fs.lookup(ROOT, "d").await.unwrap();
        fs.lookup(d.ino, "e").await.unwrap()
    }

    #[tokio::test]
    async fn write_publishes_on_flush_and_rename_moves_it() {
        let dir = tempfile::tempdir().unwrap();
        let fs = setup(dir.path());
        let d = fs.lookup(ROOT, "d").await.unwrap();
        let (a, fh) = fs.create(d.ino, "ckpt.tmp").await.unwrap();
        fs.write(fh, 0, b"hello ").await.unwrap();
        fs.write(fh, 6, b"world").await.unwrap();
        assert_eq!(fs.getattr(a.ino).unwrap().size, 11);
        assert_eq!(fs.read(fh, 0, 100).await.unwrap(), &b"hello world"[..], "a writer reads its own bytes");
        assert!(cold(dir.path(), "d/ckpt.tmp").is_none(), "nothing is visible before flush");
        fs.flush(fh).await.unwrap();
        assert_eq!(cold(dir.path(), "d/ckpt.tmp").unwrap(), b"hello world");
        fs.release(fh).await.unwrap();
        assert!(std::fs::read_dir(dir.path().join("staging")).unwrap().next().is_none(), "staging is cleaned up");
        fs.rename(d.ino, "ckpt.tmp", d.ino, "ckpt").await.unwrap();
        assert!(cold(dir.path(), "d/ckpt.tmp").is_none());
        assert_eq!(cold(dir.path(), "d/ckpt").unwrap(), b"hello world");
        let b = fs.lookup(d.ino, "ckpt").await.unwrap();
        assert_eq!(b.ino, a.ino, "a rename keeps the inode");
        let rfh = fs.open(b.ino, false, false).unwrap();
        assert_eq!(fs.read(rfh, 0, 100).await.unwrap(), &b"hello world"[..]);
        fs.unlink(d.ino, "ckpt").await.unwrap();
        assert!(cold(dir.path(), "d/ckpt").is_none());
    }

    #[tokio::test]
    async fn renaming_a_rewrite_in_progress_moves_the_old_object_away() {
        let dir = tempfile::tempdir().unwrap();
        let fs = setup(dir.path());
        let e = dir_e(&fs).await;
        let small = fs.lookup(e.ino, "small").await.unwrap();
        let fh = fs.open(small.ino, true, true).unwrap();
        fs.write(fh, 0, b"rewritten").await.unwrap();
        fs.rename(e.ino, "small", e.ino, "moved").await.unwrap();
        fs.release(fh).await.unwrap();
        assert!(cold(dir.path(), "d/e/small").is_none(), "the old object left with its name");
        assert_eq!(cold(dir.path(), "d/e/moved").unwrap(), b"rewritten");
    }

    #[tokio::test]
    async fn rename_after_fsync_while_open_sends_later_writes_to_the_new_name() {
        let dir = tempfile::tempdir().unwrap();
        let fs = setup(dir.path());
        let (_, fh) = fs.create(ROOT, "c.tmp").await.unwrap();
        fs.write(fh, 0, b"part one").await.unwrap();
        fs.flush(fh).await.unwrap();
        fs.rename(ROOT, "c.tmp", ROOT, "c").await.unwrap();
        fs.write(fh, 8, b", part two").await.unwrap();
        fs.release(fh).await.unwrap();
        assert!(cold(dir.path(), "c.tmp").is_none());
        assert_eq!(cold(dir.path(), "c").unwrap(), b"part one, part two");
    }

    #[tokio::test]
    async fn rename_before_close_retargets_the_upload() {
        let dir = tempfile::tempdir().unwrap();
        let fs = setup(dir.path());
        let (_, fh) = fs.create(ROOT, "x.tmp").await.unwrap();
        fs.write(fh, 0, b"abc").await.unwrap();
        fs.rename(ROOT, "x.tmp", ROOT, "x").await.unwrap();
        fs.release(fh).await.unwrap();
        assert!(cold(dir.path(), "x.tmp").is_none());
        assert_eq!(cold(dir.path(), "x").unwrap(), b"abc");
    }

    #[tokio::test]
    async fn existing_objects_are_rewritten_whole_or_not_at_all() {
        let dir = tempfile::tempdir().unwrap();
        let fs = setup(dir.path());
        let d = fs.lookup(ROOT, "d").await.unwrap();
        let big = fs.lookup(d.ino, "big.bin").await.unwrap();
        let rw = fs.open(big.ino, true, false).unwrap();
        assert_eq!(fs.read(rw, 0, 3).await.unwrap(), &[0u8, 1, 2][..], "a read-write open of an object reads it");
        assert!(matches!(fs.write(rw, 0, b"x").await, Err(FsError::NotSupported(_))));
        fs.release(rw).await.unwrap();
        assert!(matches!(fs.set_size(big.ino, 10).await, Err(FsError::NotSupported(_))));
        let fh = fs.open(big.ino, true, true).unwrap();
        fs.write(fh, 0, b"new").await.unwrap();
        fs.release(fh).await.unwrap();
        assert_eq!(cold(dir.path(), "d/big.bin").unwrap(), b"new");
    }

    #[tokio::test]
    async fn leftovers_upload_only_when_complete() {
        let dir = tempfile::tempdir().unwrap();
        let staging = dir.path().join("staging");
        let done = Staged::create(&staging, 7, "done.bin", None).unwrap();
        let mut s = done;
        s.write_at(0, b"whole").unwrap();
        s.seal().unwrap();
        let mut cut = Staged::create(&staging, 8, "cut.bin", None).unwrap();
        cut.write_at(0, b"par").unwrap();
        // Uploaded, then renamed, and the process died before the staged copy was cached.
        let mut sent = Staged::create(&staging, 9, "sent.tmp", None).unwrap();
        sent.write_at(0, b"renamed since").unwrap();
        sent.seal().unwrap();
        sent.forget_manifest();
        let fs = setup(dir.path());
        let report = fs.recover_staged(true).await;
        assert!(cold(dir.path(), "sent.tmp").is_none(), "content already in the store is not uploaded again");
        assert!(!sent.data_path().exists(), "its staged copy is removed");
        assert_eq!(report.len(), 2, "{report:?}");
        assert_eq!(cold(dir.path(), "done.bin").unwrap(), b"whole");
        assert!(cold(dir.path(), "cut.bin").is_none(), "a file cut off mid-write is never uploaded");
        assert!(report[1].contains("cut.bin") && report[1].contains("incomplete"), "{report:?}");
    }

    /// The kernel sends release after close has returned, so the store coming back in between
    /// must not see the file go up behind the writer that was told it failed.
    #[tokio::test]
    async fn a_failed_upload_reported_by_flush_is_not_retried_at_release_nor_at_restart() {
        let dir = tempfile::tempdir().unwrap();
        let fs = setup(dir.path());
        let e = dir_e(&fs).await;
        let (_, fh) = fs.create(e.ino, "ckpt").await.unwrap();
        fs.write(fh, 0, b"lost").await.unwrap();
        let block = || block_uploads(dir.path(), "d/e");
        let unblock = || unblock_uploads(dir.path(), "d/e");
        block();
        assert!(matches!(fs.flush(fh).await, Err(FsError::Publish { .. })), "the failed upload is flush's error");
        unblock();
        fs.release(fh).await.unwrap();
        assert!(cold(dir.path(), "d/e/ckpt").is_none(), "release uploaded what the writer was told had failed");
        let report = fs.recover_staged(true).await;
        assert!(cold(dir.path(), "d/e/ckpt").is_none(), "a restart uploaded it");
        assert_eq!(report.len(), 1, "{report:?}");
        assert!(report[0].contains("d/e/ckpt") && report[0].contains("writer was told"), "{report:?}");
        assert!(matches!(fs.lookup(e.ino, "ckpt").await, Err(FsError::NotFound)), "the name shows what the store has");

        // A rewrite whose upload failed: once closed, the name reads as the object it was.
        std::fs::write(dir.path().join("cold/d/e/kept"), b"the object as it was").unwrap();
        let kept = fs.lookup(e.ino, "kept").await.unwrap();
        let fh = fs.open(kept.ino, true, true).unwrap();
        fs.write(fh, 0, b"new").await.unwrap();
        block();
        assert!(fs.flush(fh).await.is_err());
        unblock();
        fs.release(fh).await.unwrap();
        let now = fs.lookup(e.ino, "kept").await.unwrap();
        assert_eq!(now.size, 20);
        let rfh = fs.open(now.ino, false, false).unwrap();
        assert_eq!(fs.read(rfh, 0, 100).await.unwrap(), &b"the object as it was"[..]);
        fs.release(rfh).await.unwrap();

        // A write after the failure is new content: the next close uploads it as usual.
        let (_, fh) = fs.create(e.ino, "again").await.unwrap();
        fs.write(fh, 0, b"one").await.unwrap();
        block();
        assert!(fs.flush(fh).await.is_err());
        unblock();
        fs.write(fh, 3, b" two").await.unwrap();
        fs.release(fh).await.unwrap();
        assert_eq!(cold(dir.path(), "d/e/again").unwrap(), b"one two");
    }

    #[tokio::test]
    async fn content_changed_after_a_flush_is_not_uploaded_by_a_restart_after_a_crash() {
        let dir = tempfile::tempdir().unwrap();
        let fs = setup(dir.path());
        let e = dir_e(&fs).await;
        let (_, fh) = fs.create(e.ino, "ckpt").await.unwrap();
        fs.write(fh, 0, b"first whole").await.unwrap();
        fs.flush(fh).await.unwrap();
        assert_eq!(cold(dir.path(), "d/e/ckpt").unwrap(), b"first whole");
        // More writes, then the process dies before any flush or close: the staged bytes are
        // neither the published content nor a finished one. What a restart finds in the
        // staging dir is what it finds now.
        fs.write(fh, 6, b"half").await.unwrap();
        let report = fs.recover_staged(true).await;
        assert_eq!(cold(dir.path(), "d/e/ckpt").unwrap(), b"first whole", "a restart uploaded a half-written change");
        assert_eq!(report.len(), 1, "{report:?}");
        assert!(report[0].contains("d/e/ckpt") && report[0].contains("incomplete"), "{report:?}");
    }

    /// A checkpoint fsynced and still open (a data-loader worker holds the descriptor) is
    /// deleted by a retention job; the mount then crashes. The restart must not bring the
    /// deleted checkpoint back from its staged copy.
    #[tokio::test]
    async fn a_restart_does_not_upload_again_what_a_flush_published() {
        let dir = tempfile::tempdir().unwrap();
        let fs = setup(dir.path());
        let e = dir_e(&fs).await;
        let (_, fh) = fs.create(e.ino, "ckpt").await.unwrap();
        fs.write(fh, 0, b"step 100").await.unwrap();
        fs.flush(fh).await.unwrap();
        std::fs::remove_file(dir.path().join("cold/d/e/ckpt")).unwrap();
        let report = fs.recover_staged(true).await;
        assert!(cold(dir.path(), "d/e/ckpt").is_none(), "a restart brought back a deleted checkpoint");
        assert!(report.is_empty(), "{report:?}");
        // New content after that is still known for what it is.
        fs.write(fh, 8, b", half").await.unwrap();
        let report = fs.recover_staged(true).await;
        assert!(cold(dir.path(), "d/e/ckpt").is_none());
        assert!(report.len() == 1 && report[0].contains("incomplete"), "{report:?}");
    }

    fn pattern(n: usize) -> Vec<u8> {
        (0..n as u32).map(|i| (i.wrapping_mul(7) % 253) as u8).collect()
    }

    async fn sent(fs: &FsCore, ino: u64) -> Option<u64> {
        let w = fs.writers.lock().unwrap().get(&ino).cloned()?;
        w.lock().await.stream.as_ref().map(|s| s.sent)
    }

    #[tokio::test]
    async fn a_sequential_writer_uploads_while_writing_and_the_object_appears_only_at_flush() {
        let dir = tempfile::tempdir().unwrap();
        let fs = super::tests_support::setup_with_parts(dir.path(), 4096);
        let d = fs.lookup(ROOT, "d").await.unwrap();
        let (a, fh) = fs.create(d.ino, "stream.bin").await.unwrap();
        let data = pattern(50_000);
        for (i, piece) in data.chunks(1000).enumerate() {
            fs.write(fh, i as u64 * 1000, piece).await.unwrap();
        }
        let went = sent(&fs, a.ino).await.expect("an upload started while writing");
        assert!(went >= 8192, "whole parts went up while writing: {went}");
        assert!(cold(dir.path(), "d/stream.bin").is_none(), "nothing is visible before flush");
        fs.flush(fh).await.unwrap();
        assert_eq!(cold(dir.path(), "d/stream.bin").unwrap(), data);
        let left = staging::leftovers(&dir.path().join("staging"));
        assert!(left.is_empty(), "in the store, yet left for a restart to upload: {left:?}");
        fs.release(fh).await.unwrap();
        let rfh = fs.open(a.ino, false, false).unwrap();
        assert_eq!(fs.read(rfh, 0, 60_000).await.unwrap(), &data[..]);
    }

    #[tokio::test]
    async fn a_file_past_the_stores_part_limit_goes_up_whole_at_flush() {
        let dir = tempfile::tempdir().unwrap();
        let fs = super::tests_support::setup_with_part_limit(dir.path(), 4096, 4);
        let d = fs.lookup(ROOT, "d").await.unwrap();
        let (a, fh) = fs.create(d.ino, "huge.bin").await.unwrap();
        let data = pattern(50_000);
        for (i, piece) in data.chunks(1000).enumerate() {
            fs.write(fh, i as u64 * 1000, piece).await.unwrap();
            if i == 10 {
                assert_eq!(sent(&fs, a.ino).await, Some(8192), "parts go up while the file fits the limit");
            }
        }
        assert_eq!(sent(&fs, a.ino).await, None, "the upload was given up before a fourth part of 4 KiB");
        assert!(cold(dir.path(), "d/huge.bin").is_none(), "nothing is visible before flush");
        fs.flush(fh).await.unwrap();
        assert_eq!(cold(dir.path(), "d/huge.bin").unwrap(), data, "it went up whole, in parts of 12.5 KB");
        fs.release(fh).await.unwrap();
    }

    #[tokio::test]
    async fn a_write_behind_what_was_sent_publishes_the_file_whole() {
        let dir = tempfile::tempdir().unwrap();
        let fs = super::tests_support::setup_with_parts(dir.path(), 4096);
        let d = fs.lookup(ROOT, "d").await.unwrap();
        let (a, fh) = fs.create(d.ino, "patched.bin").await.unwrap();
        let mut data = pattern(20_000);
        fs.write(fh, 0, &data).await.unwrap();
        assert!(sent(&fs, a.ino).await.is_some());
        // A header patched in at the end, as some checkpoint writers do.
        fs.write(fh, 0, b"HEADER").await.unwrap();
        data[..6].copy_from_slice(b"HEADER");
        assert_eq!(sent(&fs, a.ino).await, None, "the upload under way was given up");
        fs.write(fh, 20_000, b"tail").await.unwrap();
        data.extend_from_slice(b"tail");
        fs.flush(fh).await.unwrap();
        assert_eq!(cold(dir.path(), "d/patched.bin").unwrap(), data);
        // Writes after that publish go up while written again.
        let more = pattern(12_000);
        fs.write(fh, data.len() as u64, &more).await.unwrap();
        data.extend_from_slice(&more);
        assert!(sent(&fs, a.ino).await.is_some(), "later writes stream again");
        fs.flush(fh).await.unwrap();
        assert_eq!(cold(dir.path(), "d/patched.bin").unwrap(), data);
        fs.release(fh).await.unwrap();
        let names: Vec<String> = std::fs::read_dir(dir.path().join("cold/d"))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert!(!names.iter().any(|n| n.contains('#')), "no part of the given-up upload is left: {names:?}");
    }

    #[tokio::test]
    async fn a_staged_copy_torn_after_an_unsynced_seal_is_never_uploaded() {
        let dir = tempfile::tempdir().unwrap();
        let staging = dir.path().join("staging");
        let crc = strata_tiering::chunkfile::crc32c(b"whole");
        let mut good = Staged::create(&staging, 7, "good.bin", None).unwrap();
        good.write_at(0, b"whole").unwrap();
        good.seal_unsynced(crc).unwrap();
        let mut torn = Staged::create(&staging, 8, "torn.bin", None).unwrap();
        torn.write_at(0, b"whole").unwrap();
        torn.seal_unsynced(crc).unwrap();
        // What a crash before writeback can leave: the right length, not the right bytes.
        std::fs::write(torn.data_path(), b"wh\0le").unwrap();
        let fs = setup(dir.path());
        let report = fs.recover_staged(true).await;
        assert_eq!(cold(dir.path(), "good.bin").unwrap(), b"whole");
        assert!(cold(dir.path(), "torn.bin").is_none(), "a torn staged copy is never uploaded");
        assert!(report[1].contains("torn.bin") && report[1].contains("damaged"), "{report:?}");
    }
}
