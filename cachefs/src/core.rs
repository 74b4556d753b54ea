//! The filesystem core, free of FUSE: inodes, cached directory listings, open handles and reads
//! through the tiered cache. The FUSE adapter is a thin shell over this, and tests can drive it
//! without the kernel.

use crate::namespace::{Namespace, Node, NodeKind, NsError};
use bytes::{Bytes, BytesMut};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant, SystemTime};
use strata_tiering::{CacheError, Fetcher, TieredCache};

pub const ROOT: u64 = 1;

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
    Read { path: String, source: CacheError },
}

/// What the kernel is told about an inode.
#[derive(Debug, Clone, PartialEq)]
pub struct Attr {
    pub ino: u64,
    pub kind: NodeKind,
    pub size: u64,
    pub mtime: SystemTime,
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
    next: u64,
}

/// A listing and when it was taken.
#[derive(Debug)]
struct Listing {
    at: Instant,
    entries: Arc<Vec<(u64, Node)>>,
}

/// An open file: the version it was opened at, so a reader never mixes two versions.
struct Handle {
    path: String,
    node: Node,
    fetcher: Arc<dyn Fetcher>,
}

/// Settings of the core.
#[derive(Debug, Clone)]
pub struct FsOptions {
    /// How long a directory listing is trusted before it is listed again. `None`: forever (an
    /// immutable dataset).
    pub metadata_ttl: Option<Duration>,
}

pub struct FsCore {
    ns: Arc<dyn Namespace>,
    cache: TieredCache,
    opts: FsOptions,
    inodes: RwLock<Inodes>,
    listings: Mutex<HashMap<u64, Listing>>,
    handles: Mutex<HashMap<u64, Arc<Handle>>>,
    next_fh: std::sync::atomic::AtomicU64,
}

impl std::fmt::Debug for FsCore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FsCore").field("ns", &self.ns.describe()).finish()
    }
}

fn join(dir: &str, name: &str) -> String {
    if dir.is_empty() { name.to_string() } else { format!("{dir}/{name}") }
}

impl FsCore {
    pub fn new(ns: Arc<dyn Namespace>, cache: TieredCache, opts: FsOptions) -> FsCore {
        let root = Node {
            name: String::new(),
            kind: NodeKind::Dir,
            size: 0,
            version: String::new(),
            mtime: SystemTime::UNIX_EPOCH,
        };
        let mut inodes = Inodes { next: ROOT + 1, ..Default::default() };
        inodes.by_ino.insert(ROOT, Inode { path: String::new(), node: root });
        inodes.by_path.insert(String::new(), ROOT);
        FsCore {
            ns,
            cache,
            opts,
            inodes: RwLock::new(inodes),
            listings: Mutex::new(HashMap::new()),
            handles: Mutex::new(HashMap::new()),
            next_fh: std::sync::atomic::AtomicU64::new(1),
        }
    }

    pub fn describe(&self) -> String {
        self.ns.describe()
    }

    fn inode(&self, ino: u64) -> Result<Inode, FsError> {
        self.inodes.read().unwrap_or_else(|p| p.into_inner()).by_ino.get(&ino).cloned().ok_or(FsError::NotFound)
    }

    fn attr(ino: u64, node: &Node) -> Attr {
        Attr { ino, kind: node.kind, size: node.size, mtime: node.mtime }
    }

    /// The entries of a directory, listed at most once per TTL. Inode numbers are stable for a
    /// path for the life of the mount; a new listing refreshes the nodes (sizes, ETags).
    async fn listing(&self, ino: u64) -> Result<Arc<Vec<(u64, Node)>>, FsError> {
        {
            let l = self.listings.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(hit) = l.get(&ino)
                && self.opts.metadata_ttl.is_none_or(|ttl| hit.at.elapsed() < ttl)
            {
                return Ok(hit.entries.clone());
            }
        }
        let dir = self.inode(ino)?;
        if dir.node.kind != NodeKind::Dir {
            return Err(FsError::NotDir);
        }
        let nodes = self.ns.read_dir(&dir.path).await.map_err(|source| FsError::List {
            dir: if dir.path.is_empty() { "/".into() } else { dir.path.clone() },
            source,
        })?;
        let entries: Vec<(u64, Node)> = {
            let mut t = self.inodes.write().unwrap_or_else(|p| p.into_inner());
            nodes
                .into_iter()
                .map(|node| {
                    let path = join(&dir.path, &node.name);
                    let ino = match t.by_path.get(&path) {
                        Some(i) => *i,
                        None => {
                            let i = t.next;
                            t.next += 1;
                            t.by_path.insert(path.clone(), i);
                            i
                        }
                    };
                    t.by_ino.insert(ino, Inode { path, node: node.clone() });
                    (ino, node)
                })
                .collect()
        };
        let entries = Arc::new(entries);
        self.listings
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(ino, Listing { at: Instant::now(), entries: entries.clone() });
        Ok(entries)
    }

    pub async fn lookup(&self, parent: u64, name: &str) -> Result<Attr, FsError> {
        let entries = self.listing(parent).await?;
        entries.iter().find(|(_, n)| n.name == name).map(|(ino, n)| Self::attr(*ino, n)).ok_or(FsError::NotFound)
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

    /// Opens a file at the version the last listing saw.
    pub fn open(&self, ino: u64) -> Result<u64, FsError> {
        let i = self.inode(ino)?;
        if i.node.kind == NodeKind::Dir {
            return Err(FsError::IsDir);
        }
        let fetcher = self.ns.fetcher(&i.path, &i.node);
        let fh = self.next_fh.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let h = Arc::new(Handle { path: i.path, node: i.node, fetcher });
        self.handles.lock().unwrap_or_else(|p| p.into_inner()).insert(fh, h);
        Ok(fh)
    }

    pub fn release(&self, fh: u64) {
        self.handles.lock().unwrap_or_else(|p| p.into_inner()).remove(&fh);
    }

    /// Reads `size` bytes at `offset` of an open file, fetching only the chunks it touches,
    /// all of them at once.
    pub async fn read(&self, fh: u64, offset: u64, size: u32) -> Result<Bytes, FsError> {
        let h = self.handles.lock().unwrap_or_else(|p| p.into_inner()).get(&fh).cloned().ok_or(FsError::BadHandle)?;
        let file_size = h.node.size;
        if offset >= file_size || size == 0 {
            return Ok(Bytes::new());
        }
        let end = (offset + size as u64).min(file_size);
        let chunk = self.ns.chunk_size();
        let (first, last) = (offset / chunk, (end - 1) / chunk);
        let reads = (first..=last).map(|i| {
            let key = self.ns.chunk_key(&h.path, &h.node, i);
            let fetcher = h.fetcher.clone();
            async move { self.cache.get(&key, fetcher, Default::default()).await.map(|b| (i, b)) }
        });
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::objects::ObjectNamespace;
    use strata_tiering::source::{ColdConfig, ColdKind, ObjectSource};
    use strata_tiering::units::ByteSize;
    use strata_tiering::{CacheConfig, Policy, TierConfig};

    fn setup(dir: &std::path::Path) -> FsCore {
        let cold = dir.join("cold");
        std::fs::create_dir_all(cold.join("d/e")).unwrap();
        let big: Vec<u8> = (0..20_000u32).map(|i| (i % 251) as u8).collect();
        std::fs::write(cold.join("d/big.bin"), &big).unwrap();
        std::fs::write(cold.join("d/e/small"), b"hi").unwrap();
        let cfg =
            ColdConfig { kind: ColdKind::Local, path: Some(cold), chunk_size: ByteSize(4096), ..ColdConfig::default() };
        let source = ObjectSource::new(&cfg, dir).unwrap();
        let cache = TieredCache::open(CacheConfig {
            hot: TierConfig::new(dir.join("hot"), 1 << 20),
            warm: None,
            state_dir: dir.join("state"),
            policy: Policy::default(),
        })
        .unwrap();
        FsCore::new(Arc::new(ObjectNamespace::new(source)), cache, FsOptions { metadata_ttl: None })
    }

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
        let fh = fs.open(big.ino).unwrap();
        let want: Vec<u8> = (0..20_000u32).map(|i| (i % 251) as u8).collect();
        // Within one chunk, across three chunks, and past the end.
        assert_eq!(fs.read(fh, 10, 100).await.unwrap(), want[10..110]);
        assert_eq!(fs.read(fh, 4000, 9000).await.unwrap(), want[4000..13000]);
        assert_eq!(fs.read(fh, 19_990, 4096).await.unwrap(), want[19_990..]);
        assert!(fs.read(fh, 20_000, 10).await.unwrap().is_empty());
        fs.release(fh);
        assert!(matches!(fs.read(fh, 0, 1).await, Err(FsError::BadHandle)));
        assert!(matches!(fs.lookup(d.ino, "nope").await, Err(FsError::NotFound)));
        assert!(matches!(fs.open(d.ino), Err(FsError::IsDir)));
        assert!(matches!(fs.readdir(big.ino).await, Err(FsError::NotDir)));
    }
}
