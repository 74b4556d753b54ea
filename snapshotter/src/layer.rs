//! An eStargz layer as a cachefs [`Namespace`]: the tree comes from the verified TOC, and each
//! chunk from a ranged read of the registry blob, decompressed and checked against its
//! `chunkDigest` before the cache sees it. Chunks are keyed by digest, so a chunk shared by
//! several layers or images is fetched and stored once.
//!
//! The tree is shown as containerd's overlay unpack leaves a layer: `.wh.NAME` becomes a 0/0
//! character device NAME, `.wh..wh..opq` becomes `trusted.overlay.opaque=y` on its directory,
//! and the names of one hard-link group share an inode.

use crate::estargz::{self, Chunk, EntryKind, Toc};
use crate::fetch::LayerFetcher;
use crate::registry::{ImageRef, Registry};
use foldhash::{HashMap, HashSet};
use futures::future::BoxFuture;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::{Duration, SystemTime};
use strata_cachefs::namespace::Posix;
use strata_cachefs::{Namespace, Node, NodeKind, NsError};
use strata_tiering::{ChunkKey, Fetcher};

const WHITEOUT: &str = ".wh.";
const OPAQUE: &str = ".wh..wh..opq";
pub const OPAQUE_XATTR: &str = "trusted.overlay.opaque";

#[derive(Debug, thiserror::Error)]
pub enum LayerError {
    #[error(
        "layer {layer}: chunks are not all {chunk_size} bytes ({path:?} has one of {size}), so it cannot be read lazily"
    )]
    UnevenChunks { layer: String, chunk_size: u64, path: String, size: u64 },
    #[error("layer {layer}: {path:?}: {reason}")]
    Tree { layer: String, path: String, reason: String },
}

/// The registry blob a layer's chunks come from, and how much of it has been read.
#[derive(Debug)]
pub struct Blob {
    pub registry: Arc<Registry>,
    pub image: ImageRef,
    pub digest: String,
    /// The blob's size in bytes.
    pub size: u64,
    /// Compressed bytes fetched for chunks so far.
    pub fetched: AtomicU64,
    /// Chunk fetches for reads in progress; background fill waits while there are any.
    pub demand: std::sync::atomic::AtomicUsize,
    /// Counts chunks whose bytes did not match their digest.
    pub rejects: strata_tiering::metrics::Metrics,
    /// The node's clock of container reads, which background fill waits on.
    pub activity: Arc<crate::activity::Activity>,
    /// How far demand reads have walked the blob, and the read ahead of them in flight.
    pub(crate) walk: std::sync::Mutex<crate::readaround::Walk>,
    /// Where read-around puts the chunks it brings: the cache the layer is mounted over.
    pub cache: std::sync::OnceLock<strata_tiering::TieredCache>,
    /// Files opened through the layer's mount, for `strata convert --record`.
    pub opened: crate::record::Opened,
    /// Bumped each time read-around, read-ahead or fill caches a chunk, so a reader waiting on
    /// a range in flight goes on as soon as its own chunk is in, not when the whole range is.
    pub cached: tokio::sync::watch::Sender<u64>,
    /// Files already fetched ahead for a starting program's loader, so each is asked once.
    pub(crate) followed: std::sync::Mutex<std::collections::HashSet<String>>,
    /// The node's open layers, where a program's libraries are looked for past this layer.
    pub(crate) layers: Arc<crate::loader::Layers>,
    /// The digests of the layers under this one in its snapshot chain, nearest first, once
    /// known.
    pub(crate) lower: std::sync::OnceLock<Vec<String>>,
    /// Requests for chunks made before the TOC was parsed (the image's program's), each taken
    /// by the first fetch of the range it was made for.
    early: std::sync::Mutex<Vec<crate::early::EarlyPrefetch>>,
    /// Where reads wait for the layer's prefetch region, if a container start waits for it.
    pub(crate) region: std::sync::OnceLock<crate::gate::RegionGate>,
    /// The peer tier, which the blob's bytes come through when the node has one.
    pub(crate) peers: Option<Arc<crate::peer_blobs::PeerBlobs>>,
}

impl Blob {
    pub fn new(registry: Arc<Registry>, image: ImageRef, digest: String, size: u64) -> Blob {
        Blob {
            registry,
            image,
            digest,
            size,
            fetched: AtomicU64::new(0),
            demand: Default::default(),
            rejects: Default::default(),
            activity: Default::default(),
            walk: Default::default(),
            cache: Default::default(),
            opened: Default::default(),
            cached: tokio::sync::watch::Sender::new(0),
            followed: Default::default(),
            layers: Default::default(),
            lower: Default::default(),
            early: Default::default(),
            region: Default::default(),
            peers: None,
        }
    }

    /// Fetches the blob's bytes through `peers`, when given.
    pub fn with_peers(mut self, peers: Option<Arc<crate::peer_blobs::PeerBlobs>>) -> Blob {
        self.peers = peers;
        self
    }

    /// Bytes `range` of the blob as they arrive: through the peer tier when the node has one,
    /// else from the registry.
    pub(crate) async fn range_stream(
        &self,
        range: std::ops::Range<u64>,
    ) -> Result<crate::registry::range_stream::RangeStream, crate::registry::RegistryError> {
        match &self.peers {
            Some(p) => Ok(p.range_stream(&self.registry, &self.image, &self.digest, self.size, range)),
            None => self.registry.blob_range_stream(&self.image, &self.digest, range).await,
        }
    }

    /// Keeps `asked`, requests for chunks made before the TOC was parsed, for the fetches of
    /// their ranges to take, for `kept` at most: those not taken by then are stopped.
    pub(crate) fn offer_early(self: &Arc<Self>, asked: Vec<crate::early::EarlyPrefetch>, kept: std::time::Duration) {
        if asked.is_empty() {
            return;
        }
        self.early.lock().unwrap_or_else(|p| p.into_inner()).extend(asked);
        let blob = Arc::downgrade(self);
        tokio::spawn(async move {
            tokio::time::sleep(kept).await;
            if let Some(blob) = blob.upgrade() {
                let left = std::mem::take(&mut *blob.early.lock().unwrap_or_else(|p| p.into_inner()));
                if !left.is_empty() {
                    tracing::debug!(layer = %blob.digest, left = left.len(), "chunks asked for before the TOC was parsed were not fetched: stopped");
                }
            }
        });
    }

    /// The request made early for bytes `range`, if there is one.
    pub(crate) fn take_early(&self, range: &std::ops::Range<u64>) -> Option<crate::early::EarlyPrefetch> {
        let mut early = self.early.lock().unwrap_or_else(|p| p.into_inner());
        let i = early.iter().position(|e| e.range == *range)?;
        Some(early.swap_remove(i))
    }

    /// Counts rejected chunks in `metrics` (the daemon's), not in a private set.
    pub fn with_metrics(mut self, metrics: strata_tiering::metrics::Metrics) -> Blob {
        self.rejects = metrics;
        self
    }

    /// Looks for the libraries of programs started from this layer in the node's `layers` too.
    pub fn with_layers(mut self, layers: Arc<crate::loader::Layers>) -> Blob {
        self.layers = layers;
        self
    }

    /// Says which layers are under this one (their digests, nearest first), where a program
    /// started from it has its libraries looked for.
    pub fn set_lower(&self, digests: Vec<String>) {
        let _ = self.lower.set(digests);
    }

    /// Reports reads to the node's `activity`, not to a private clock.
    pub fn with_activity(mut self, activity: Arc<crate::activity::Activity>) -> Blob {
        self.activity = activity;
        self
    }
}

/// A regular file's chunks, in file order.
#[derive(Debug)]
pub(crate) struct FileData {
    pub(crate) path: String,
    pub(crate) chunks: Vec<Chunk>,
}

#[derive(Debug)]
pub(crate) struct Tree {
    describe: String,
    landmark: estargz::Landmark,
    /// Every distinct chunk with a file it belongs to, in blob order.
    pub(crate) pieces: Arc<Vec<(String, Chunk)>>,
    root: Node,
    dirs: HashMap<String, Vec<Node>>,
    files: HashMap<String, Arc<FileData>>,
    links: HashMap<String, String>,
    xattrs: HashMap<String, BTreeMap<String, Vec<u8>>>,
    pub(crate) chunk_size: u64,
}

/// Symlinks followed in one path at most, as the kernel's limit.
const MAX_SYMLINKS: usize = 40;

impl Tree {
    /// Adds `node` to directory `parent`, whose name is copied only the first time.
    fn child(&mut self, parent: &str, node: Node) {
        match self.dirs.get_mut(parent) {
            Some(children) => children.push(node),
            None => {
                self.dirs.insert(parent.to_owned(), vec![node]);
            }
        }
    }

    /// The regular file that `path` (absolute or not) names in this layer, following symlinks
    /// in every component as the kernel would, without leaving the layer's root.
    pub(crate) fn resolve(&self, path: &str) -> Option<Arc<FileData>> {
        let mut todo: std::collections::VecDeque<String> = path.split('/').map(str::to_owned).collect();
        let mut at: Vec<String> = Vec::new();
        let mut hops = 0;
        while let Some(part) = todo.pop_front() {
            match part.as_str() {
                "" | "." => continue,
                ".." => {
                    at.pop();
                    continue;
                }
                _ => at.push(part),
            }
            if let Some(target) = self.links.get(&at.join("/")) {
                hops += 1;
                if hops > MAX_SYMLINKS {
                    return None;
                }
                at.pop();
                if target.starts_with('/') {
                    at.clear();
                }
                for part in target.split('/').rev() {
                    todo.push_front(part.to_owned());
                }
            }
        }
        self.files.get(&at.join("/")).cloned()
    }
}

/// The namespace of one mounted layer. Cheap to clone.
#[derive(Debug, Clone)]
pub struct LayerNamespace {
    tree: Arc<Tree>,
    blob: Arc<Blob>,
}

/// The kernel's encoding of a device number (`new_encode_dev`).
fn encode_dev(major: u32, minor: u32) -> u32 {
    (minor & 0xff) | ((major & 0xfff) << 8) | ((minor & !0xff) << 12)
}

fn parent_and_name(path: &str) -> (&str, &str) {
    path.rsplit_once('/').unwrap_or(("", path))
}

impl LayerNamespace {
    pub fn new(toc: &Toc, blob: Arc<Blob>) -> Result<LayerNamespace, LayerError> {
        let describe = format!("{}@{}", blob.image, blob.digest);
        let chunk_size = uniform_chunk_size(toc, &describe)?;
        // Hard-link groups: a regular file and every link to it share the link id.
        let mut names_of: HashMap<&str, u32> = HashMap::default();
        for e in &toc.entries {
            if let EntryKind::Hardlink(target) = &e.kind {
                *names_of.entry(target.as_str()).or_insert(1) += 1;
            }
        }
        // The entries of link targets, and each one's first place in the TOC, its group's id:
        // looked up once per link, so a layer of many hard links (a conda environment linked
        // to its package cache) builds in linear time. Most layers have no links, and then
        // neither map is built.
        let mut by_path: HashMap<&str, &estargz::Entry> = HashMap::default();
        let mut first_at: HashMap<&str, u64> = HashMap::default();
        if !names_of.is_empty() {
            for (i, e) in toc.entries.iter().enumerate() {
                if names_of.contains_key(e.path.as_str()) {
                    by_path.insert(e.path.as_str(), e);
                    first_at.entry(e.path.as_str()).or_insert(i as u64);
                }
            }
        }
        let link_id = |target: &str| first_at.get(target).copied();
        let mut subdirs: HashMap<&str, u32> = HashMap::default();
        for e in toc.entries.iter().filter(|e| e.kind == EntryKind::Dir && !e.path.is_empty()) {
            *subdirs.entry(parent_and_name(&e.path).0).or_default() += 1;
        }
        let mtime = |s: i64| {
            if s >= 0 {
                SystemTime::UNIX_EPOCH + Duration::from_secs(s as u64)
            } else {
                SystemTime::UNIX_EPOCH - Duration::from_secs(s.unsigned_abs())
            }
        };
        let mut pieces: Vec<(String, Chunk)> = Vec::new();
        let mut seen: HashSet<&str> = HashSet::default();
        for e in &toc.entries {
            for c in &e.chunks {
                if seen.insert(c.digest.as_str()) {
                    pieces.push((e.path.clone(), c.clone()));
                }
            }
        }
        pieces.sort_by_key(|(_, c)| (c.offset, c.inner_offset));
        let mut tree = Tree {
            describe: describe.clone(),
            landmark: toc.landmark,
            pieces: Arc::new(pieces),
            root: Node::dir("", SystemTime::UNIX_EPOCH),
            dirs: HashMap::default(),
            files: HashMap::default(),
            links: HashMap::default(),
            xattrs: HashMap::default(),
            chunk_size,
        };
        for e in &toc.entries {
            let (parent, name) = parent_and_name(&e.path);
            if name == OPAQUE {
                tree.xattrs.entry(parent.to_owned()).or_default().insert(OPAQUE_XATTR.into(), b"y".to_vec());
                continue;
            }
            if let Some(hidden) = name.strip_prefix(WHITEOUT) {
                // `.wh..` and `.wh...` would hide `.` and `..`, which no directory lists.
                if matches!(hidden, "" | "." | "..") || hidden.starts_with(WHITEOUT) {
                    return Err(LayerError::Tree {
                        layer: describe,
                        path: e.path.clone(),
                        reason: "a whiteout without a name".into(),
                    });
                }
                let posix = Posix { mode: 0, uid: e.uid, gid: e.gid, nlink: 1, rdev: 0, link: None };
                let node = Node {
                    name: hidden.to_owned(),
                    kind: NodeKind::CharDev,
                    size: 0,
                    version: String::new(),
                    mtime: mtime(e.mtime),
                    posix: Some(posix),
                };
                tree.child(parent, node);
                continue;
            }
            // A hard link is its target's inode under another name.
            let (meta, link) = match &e.kind {
                EntryKind::Hardlink(target) => (by_path[target.as_str()], link_id(target)),
                EntryKind::Reg if names_of.contains_key(e.path.as_str()) => (e, link_id(&e.path)),
                _ => (e, None),
            };
            let (kind, rdev, size) = match &meta.kind {
                EntryKind::Dir => (NodeKind::Dir, 0, 0),
                EntryKind::Reg | EntryKind::Hardlink(_) => (NodeKind::File, 0, meta.size),
                EntryKind::Symlink(t) => (NodeKind::Symlink, 0, t.len() as u64),
                EntryKind::Char { major, minor } => (NodeKind::CharDev, encode_dev(*major, *minor), 0),
                EntryKind::Block { major, minor } => (NodeKind::BlockDev, encode_dev(*major, *minor), 0),
                EntryKind::Fifo => (NodeKind::Fifo, 0, 0),
            };
            let nlink = match kind {
                NodeKind::Dir => 2 + subdirs.get(e.path.as_str()).copied().unwrap_or(0),
                NodeKind::File => names_of.get(meta.path.as_str()).copied().unwrap_or(1),
                _ => 1,
            };
            let node = Node {
                name: name.to_owned(),
                kind,
                size,
                version: meta.digest.clone().unwrap_or_default(),
                mtime: mtime(meta.mtime),
                posix: Some(Posix { mode: meta.mode, uid: meta.uid, gid: meta.gid, nlink, rdev, link }),
            };
            if let EntryKind::Symlink(t) = &meta.kind {
                tree.links.insert(e.path.clone(), t.clone());
            }
            if !meta.xattrs.is_empty() {
                tree.xattrs.entry(e.path.clone()).or_default().extend(meta.xattrs.clone());
            }
            if kind == NodeKind::File {
                let data = FileData { path: meta.path.clone(), chunks: meta.chunks.clone() };
                tree.files.insert(e.path.clone(), Arc::new(data));
            }
            if e.path.is_empty() {
                tree.root = node;
            } else {
                if kind == NodeKind::Dir && !tree.dirs.contains_key(e.path.as_str()) {
                    tree.dirs.insert(e.path.clone(), Vec::new());
                }
                tree.child(parent, node);
            }
        }
        Ok(LayerNamespace { tree: Arc::new(tree), blob })
    }

    pub fn blob(&self) -> &Arc<Blob> {
        &self.blob
    }

    pub(crate) fn parts(&self) -> (&Arc<Blob>, &Arc<Tree>) {
        (&self.blob, &self.tree)
    }

    /// Every distinct chunk of the layer, with a file it belongs to, in blob order.
    pub fn pieces(&self) -> Arc<Vec<(String, Chunk)>> {
        self.tree.pieces.clone()
    }

    pub fn piece_count(&self) -> usize {
        self.tree.pieces.len()
    }

    pub fn landmark(&self) -> estargz::Landmark {
        self.tree.landmark
    }

    /// The chunks of the regular file at `path` (as the TOC names it: no leading `/`), if the
    /// layer holds one.
    pub fn file_chunks(&self, path: &str) -> Option<&[Chunk]> {
        self.tree.files.get(path).map(|f| f.chunks.as_slice())
    }
}

/// The one chunk size every file of the layer is cut at (its last chunk may be shorter), which
/// cachefs needs to map offsets to chunks. Writers use one size per layer; a layer that mixes
/// sizes is refused, and read whole instead.
fn uniform_chunk_size(toc: &Toc, layer: &str) -> Result<u64, LayerError> {
    let multi = toc.entries.iter().filter(|e| e.chunks.len() > 1).map(|e| e.chunks[0].size).max();
    let largest_single =
        toc.entries.iter().filter(|e| e.chunks.len() == 1).map(|e| e.chunks[0].size).max().unwrap_or(0);
    let size = multi.unwrap_or(largest_single.max(4 << 20));
    for e in &toc.entries {
        let last = e.chunks.len().saturating_sub(1);
        for (i, c) in e.chunks.iter().enumerate() {
            if (i < last && c.size != size) || c.size > size {
                return Err(LayerError::UnevenChunks {
                    layer: layer.to_owned(),
                    chunk_size: size,
                    path: e.path.clone(),
                    size: c.size,
                });
            }
        }
    }
    Ok(size)
}

impl Namespace for LayerNamespace {
    fn describe(&self) -> String {
        self.tree.describe.clone()
    }

    fn root(&self) -> Option<Node> {
        Some(self.tree.root.clone())
    }

    fn read_dir(&self, dir: &str) -> BoxFuture<'static, Result<Vec<Node>, NsError>> {
        let found = self.tree.dirs.get(dir).cloned();
        let dir = dir.to_owned();
        Box::pin(async move { found.ok_or_else(|| NsError::Other(format!("{dir}: no such directory in the layer"))) })
    }

    fn stat(&self, path: &str) -> BoxFuture<'static, Result<Option<Node>, NsError>> {
        let (dir, name) = parent_and_name(path);
        let found = self.tree.dirs.get(dir).and_then(|nodes| nodes.iter().find(|n| n.name == name)).cloned();
        Box::pin(async move { Ok(found) })
    }

    fn read_link(&self, path: &str) -> BoxFuture<'static, Result<String, NsError>> {
        let found = self.tree.links.get(path).cloned();
        let path = path.to_owned();
        Box::pin(async move { found.ok_or_else(|| NsError::Other(format!("{path} is not a symlink"))) })
    }

    fn xattrs(&self, path: &str) -> BoxFuture<'static, Result<BTreeMap<String, Vec<u8>>, NsError>> {
        let found = self.tree.xattrs.get(path).cloned().unwrap_or_default();
        Box::pin(async move { Ok(found) })
    }

    fn chunk_size(&self) -> u64 {
        self.tree.chunk_size
    }

    fn chunk_key(&self, path: &str, _node: &Node, index: u64) -> ChunkKey {
        match self.tree.files.get(path).and_then(|f| f.chunks.get(index as usize)) {
            Some(c) => ChunkKey::digest(path, c.digest.clone()),
            // Past the end: a key that no fetch can satisfy, so the read fails rather than
            // returning some other chunk's bytes.
            None => ChunkKey::digest(path, format!("none:{index}")),
        }
    }

    fn fetcher(&self, path: &str, _node: &Node) -> Arc<dyn Fetcher> {
        // Called on every open of a regular file through the mount.
        self.blob.opened.note(path);
        Arc::new(LayerFetcher {
            blob: self.blob.clone(),
            file: self.tree.files.get(path).cloned(),
            tree: self.tree.clone(),
            ahead: false,
        })
    }
}

#[cfg(test)]
mod tree_tests;
