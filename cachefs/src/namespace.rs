//! The `Namespace` trait: what cachefs needs from a source of files. A dataset is a namespace
//! whose tree comes from an object listing; an image layer (later) is one whose tree comes from
//! an eStargz TOC. Both hand out chunk keys and a fetcher, and the tiered cache does the rest.

use futures::future::BoxFuture;
use std::sync::Arc;
use std::time::SystemTime;
use strata_tiering::source::SourceError;
use strata_tiering::upload::PartUpload;
use strata_tiering::{ChunkKey, Fetcher};

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum NodeKind {
    File,
    Dir,
    Symlink,
    CharDev,
    BlockDev,
    Fifo,
}

/// Ownership and permissions a namespace knows (an image layer does; an object store does
/// not, and its files get the mount's owner and default modes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Posix {
    /// Permission bits with setuid, setgid and sticky.
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    pub nlink: u32,
    /// Device number of a character or block device, as the kernel encodes it.
    pub rdev: u32,
    /// Entries with the same link id are hard links of one file, shown as one inode.
    pub link: Option<u64>,
}

/// One entry of a directory.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Node {
    pub name: String,
    pub kind: NodeKind,
    pub size: u64,
    /// What identifies this content (an ETag); empty for directories.
    pub version: String,
    pub mtime: SystemTime,
    pub posix: Option<Posix>,
}

impl Node {
    /// A directory the namespace makes up (the root, or a parent no listing names), with no
    /// owner or mode of its own.
    pub fn dir(name: impl Into<String>, mtime: SystemTime) -> Node {
        Node { name: name.into(), kind: NodeKind::Dir, size: 0, version: String::new(), mtime, posix: None }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum NsError {
    #[error(transparent)]
    Source(#[from] SourceError),
    #[error("{0} is read-only")]
    ReadOnly(String),
    #[error("{0}")]
    Other(String),
}

/// Keeps the ID of an upload that is starting, to abort it after a crash.
pub type UploadNote = Box<dyn FnOnce(&str) + Send>;

/// Parts of an upload sent while its file is written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Streaming {
    /// Bytes in each part.
    pub part: u64,
    /// Parts in flight.
    pub parallel: usize,
    /// The most parts the store takes in one upload.
    pub max_parts: u64,
}

pub trait Namespace: Send + Sync + 'static {
    /// Where the files come from, for messages.
    fn describe(&self) -> String;

    /// The root directory's own entry, when the namespace knows its owner and mode.
    fn root(&self) -> Option<Node> {
        None
    }

    /// The entries of the directory at `dir` (relative, "" for the root).
    fn read_dir(&self, dir: &str) -> BoxFuture<'static, Result<Vec<Node>, NsError>>;

    /// As [`Namespace::read_dir`], listed at most `max_age` ago (`None`: any age), with how
    /// long ago the listing was made: one that a peer made for the cluster is older than this
    /// call, and the caller's cache expires it that much sooner.
    fn read_dir_aged(
        &self,
        dir: &str,
        _max_age: Option<std::time::Duration>,
    ) -> BoxFuture<'static, Result<(Vec<Node>, std::time::Duration), NsError>> {
        let listing = self.read_dir(dir);
        Box::pin(async move { Ok((listing.await?, std::time::Duration::ZERO)) })
    }

    /// The entry at `path` (relative, not the root), or `None` if there is none. The default
    /// reads the parent directory; namespaces that can ask about one name do better.
    fn stat(&self, path: &str) -> BoxFuture<'static, Result<Option<Node>, NsError>> {
        let (dir, name) = path.rsplit_once('/').unwrap_or(("", path));
        let (listing, name) = (self.read_dir(dir), name.to_string());
        Box::pin(async move { Ok(listing.await?.into_iter().find(|n| n.name == name)) })
    }

    /// As [`Namespace::stat`], from the store at most `max_age` ago (`None`: any age), and an
    /// answer that the name is missing at most `max_missing_age` ago, with the answer's age:
    /// one that a peer had for the cluster is older than this call.
    fn stat_aged(
        &self,
        path: &str,
        _max_age: Option<std::time::Duration>,
        _max_missing_age: std::time::Duration,
    ) -> BoxFuture<'static, Result<(Option<Node>, std::time::Duration), NsError>> {
        let stat = self.stat(path);
        Box::pin(async move { Ok((stat.await?, std::time::Duration::ZERO)) })
    }

    /// The target of the symlink at `path`.
    fn read_link(&self, path: &str) -> BoxFuture<'static, Result<String, NsError>> {
        let e = NsError::Other(format!("{path} is not a symlink"));
        Box::pin(async move { Err(e) })
    }

    /// The extended attributes of the entry at `path`.
    fn xattrs(&self, _path: &str) -> BoxFuture<'static, Result<std::collections::BTreeMap<String, Vec<u8>>, NsError>> {
        Box::pin(async { Ok(Default::default()) })
    }

    /// Bytes per chunk of a file's data.
    fn chunk_size(&self) -> u64;

    /// The key of chunk `index` of the file at `path`, whose listing gave `node`.
    fn chunk_key(&self, path: &str, node: &Node, index: u64) -> ChunkKey;

    /// What fetches the chunks of that file on a miss.
    fn fetcher(&self, path: &str, node: &Node) -> Arc<dyn Fetcher>;

    /// Makes the local file `staged` the content at `path`, atomically: readers see the old
    /// content or the new, never a part. `note` gets the ID of an upload in parts before its
    /// first part goes, where the store has one. Returns the new node.
    fn publish(
        &self,
        path: &str,
        _staged: &std::path::Path,
        _note: UploadNote,
    ) -> BoxFuture<'static, Result<Node, NsError>> {
        let e = NsError::ReadOnly(self.describe());
        let _ = path;
        Box::pin(async move { Err(e) })
    }

    /// How uploads that start while a file is still being written go; `None` when files are
    /// only published whole.
    fn streaming(&self) -> Option<Streaming> {
        None
    }

    /// Starts a multipart upload of the content at `path`, to be sent part by part.
    fn begin_upload(&self, _path: &str) -> BoxFuture<'static, Result<PartUpload, NsError>> {
        let e = NsError::ReadOnly(self.describe());
        Box::pin(async move { Err(e) })
    }

    /// Aborts upload `id` of the content at `path`, begun by an earlier run that crashed, so the
    /// store drops its parts.
    fn abort_upload(&self, _path: &str, _id: &str) -> BoxFuture<'static, Result<(), NsError>> {
        Box::pin(async { Ok(()) })
    }

    /// Completes an upload begun with [`Namespace::begin_upload`]: the content appears whole.
    fn finish_upload(&self, upload: PartUpload) -> BoxFuture<'static, Result<Node, NsError>> {
        let e = NsError::ReadOnly(self.describe());
        Box::pin(async move {
            upload.abort().await;
            Err(e)
        })
    }

    fn remove(&self, _path: &str) -> BoxFuture<'static, Result<(), NsError>> {
        let e = NsError::ReadOnly(self.describe());
        Box::pin(async move { Err(e) })
    }

    /// Deletes every file of `paths`; one already gone counts as deleted. Returns the first
    /// failure, with its path. The default deletes one by one; stores that delete in bulk do
    /// better.
    fn remove_all(&self, paths: Vec<String>) -> BoxFuture<'_, Result<(), (String, NsError)>> {
        Box::pin(async move {
            for p in paths {
                match self.remove(&p).await {
                    Err(NsError::Source(e)) if e.is_not_found() => {}
                    Err(e) => return Err((p, e)),
                    Ok(()) => {}
                }
            }
            Ok(())
        })
    }

    /// Renames the file at `from`, last seen as `known`, to `to`. Returns the new node.
    fn rename(&self, _from: &str, _known: &Node, _to: &str) -> BoxFuture<'static, Result<Node, NsError>> {
        let e = NsError::ReadOnly(self.describe());
        Box::pin(async move { Err(e) })
    }

    /// Every file under the directory `dir`, at any depth: its path, and its node as listed.
    fn list_tree(&self, _dir: &str) -> BoxFuture<'static, Result<Vec<(String, Node)>, NsError>> {
        let e = NsError::ReadOnly(self.describe());
        Box::pin(async move { Err(e) })
    }

    /// Copies the file at `from`, which a listing gave as `listed`, to `to`, replacing it.
    /// Returns the new node.
    fn copy(&self, _from: &str, _listed: &Node, _to: &str) -> BoxFuture<'static, Result<Node, NsError>> {
        let e = NsError::ReadOnly(self.describe());
        Box::pin(async move { Err(e) })
    }
}
