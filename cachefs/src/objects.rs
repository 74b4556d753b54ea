//! The dataset namespace: a bucket prefix (or local directory) whose `/`-delimited keys become
//! directories, served by ranged GETs keyed by ETag.

use crate::namespace::{Namespace, Node, NodeKind, NsError, Streaming, UploadNote};
use futures::FutureExt;
use futures::future::BoxFuture;
use std::sync::Arc;
use std::time::SystemTime;
use strata_tiering::source::{ObjectInfo, ObjectSource, Stat};
use strata_tiering::upload::PartUpload;
use strata_tiering::{ChunkKey, Fetcher};

#[derive(Debug, Clone)]
pub struct ObjectNamespace {
    source: ObjectSource,
    /// Sub-prefix of the source this namespace shows, so a mount of `datasets/imagenet` of the
    /// daemon's store names its chunks exactly as `strata tier warmup datasets/imagenet/` does.
    root: String,
    /// Put before every chunk key's path: a source other than the node's store has keys of its
    /// own, so that the same name and ETag in two buckets or directories never share chunks.
    key_space: String,
    part_size: usize,
    parallel: usize,
}

impl ObjectNamespace {
    /// Uploads go in one PUT up to `part_size`, as multipart uploads of that part size above it.
    pub fn new(source: ObjectSource, part_size: usize, parallel: usize) -> Self {
        ObjectNamespace { source, root: String::new(), key_space: String::new(), part_size, parallel }
    }

    /// Shows only what is under `root` inside the source.
    pub fn with_root(mut self, root: &str) -> Self {
        self.root = root.trim_matches('/').to_string();
        self
    }

    /// Names this namespace's chunks `{space}{key}` in the cache.
    pub fn with_key_space(mut self, space: &str) -> Self {
        self.key_space = space.to_string();
        self
    }

    /// The source-relative key of a path in this namespace.
    fn key(&self, path: &str) -> String {
        match (self.root.is_empty(), path.is_empty()) {
            (true, _) => path.to_string(),
            (false, true) => self.root.clone(),
            (false, false) => format!("{}/{path}", self.root),
        }
    }

    /// Every object under the root, for a namespace snapshot, with paths relative to the root:
    /// listed at most `max_age` ago (through the prefix's owner when the mount is
    /// cluster-shared), and how long ago that was.
    pub async fn list_all(
        &self,
        max_age: std::time::Duration,
    ) -> Result<(Vec<crate::snapshot::Entry>, std::time::Duration), NsError> {
        let prefix = if self.root.is_empty() { String::new() } else { format!("{}/", self.root) };
        let (objects, age) = self.source.list_aged(&prefix, max_age).await?;
        let entries = objects
            .into_iter()
            .filter_map(|o| {
                let rel = o.path.strip_prefix(&prefix)?.to_string();
                let mtime = o.modified.duration_since(SystemTime::UNIX_EPOCH).map(|d| d.as_secs() as i64).unwrap_or(0);
                (!rel.is_empty() && !rel.ends_with('/'))
                    .then_some(crate::snapshot::Entry(rel, o.size, o.version, mtime))
            })
            .collect();
        Ok((entries, age))
    }

    fn dir_node(name: String) -> Node {
        Node { name, kind: NodeKind::Dir, size: 0, version: String::new(), mtime: SystemTime::UNIX_EPOCH, posix: None }
    }

    fn node(o: ObjectInfo) -> Node {
        let name = o.path.rsplit('/').next().unwrap_or(&o.path).to_string();
        Node { name, kind: NodeKind::File, size: o.size, version: o.version, mtime: o.modified, posix: None }
    }

    fn info(&self, path: &str, node: &Node) -> ObjectInfo {
        ObjectInfo { path: self.key(path), size: node.size, version: node.version.clone(), modified: node.mtime }
    }
}

impl Namespace for ObjectNamespace {
    fn describe(&self) -> String {
        if self.root.is_empty() {
            self.source.describe().to_string()
        } else {
            format!("{} prefix {}", self.source.describe(), self.root)
        }
    }

    fn read_dir(&self, dir: &str) -> BoxFuture<'static, Result<Vec<Node>, NsError>> {
        let listing = self.read_dir_aged(dir, Some(std::time::Duration::ZERO));
        async move { Ok(listing.await?.0) }.boxed()
    }

    fn read_dir_aged(
        &self,
        dir: &str,
        max_age: Option<std::time::Duration>,
    ) -> BoxFuture<'static, Result<(Vec<Node>, std::time::Duration), NsError>> {
        let source = self.source.clone();
        let dir = self.key(dir);
        async move {
            let (dirs, objects, age) = source.list_dir_aged(&dir, max_age).await?;
            let mut out: Vec<Node> = dirs
                .into_iter()
                .map(|name| Node {
                    name,
                    kind: NodeKind::Dir,
                    size: 0,
                    version: String::new(),
                    mtime: SystemTime::UNIX_EPOCH,
                    posix: None,
                })
                .collect();
            for o in objects {
                let name = o.path.rsplit('/').next().unwrap_or(&o.path).to_string();
                // A key ending in `/` is a directory marker some tools create; it is not a file.
                if name.is_empty() {
                    continue;
                }
                out.push(Node {
                    name,
                    kind: NodeKind::File,
                    size: o.size,
                    version: o.version,
                    mtime: o.modified,
                    posix: None,
                });
            }
            Ok((out, age))
        }
        .boxed()
    }

    /// A HEAD for a file; failing that, one page of a listing for a directory. Cheap next to
    /// listing a large parent directory just to look up one name.
    fn stat(&self, path: &str) -> BoxFuture<'static, Result<Option<Node>, NsError>> {
        let (source, key) = (self.source.clone(), self.key(path));
        let name = path.rsplit('/').next().unwrap_or(path).to_string();
        async move {
            match source.head(&key).await {
                Ok(o) => return Ok(Some(Self::node(o))),
                Err(e) if e.is_not_found() => {}
                Err(e) => return Err(e.into()),
            }
            Ok(source.exists_under(&key).await?.then(|| Self::dir_node(name)))
        }
        .boxed()
    }

    /// As `stat`, through the key's owner when the mount is cluster-shared.
    fn stat_aged(
        &self,
        path: &str,
        max_age: Option<std::time::Duration>,
        max_missing_age: std::time::Duration,
    ) -> BoxFuture<'static, Result<(Option<Node>, std::time::Duration), NsError>> {
        let (source, key) = (self.source.clone(), self.key(path));
        let name = path.rsplit('/').next().unwrap_or(path).to_string();
        async move {
            let (stat, age) = source.stat_aged(&key, max_age, max_missing_age).await?;
            let node = match stat {
                Stat::File(o) => Some(Self::node(o)),
                Stat::Dir => Some(Self::dir_node(name)),
                Stat::Missing => None,
            };
            Ok((node, age))
        }
        .boxed()
    }

    fn chunk_size(&self) -> u64 {
        self.source.chunk_size()
    }

    fn chunk_key(&self, path: &str, node: &Node, index: u64) -> ChunkKey {
        let key = self.key(path);
        let path = if self.key_space.is_empty() { key } else { format!("{}{key}", self.key_space) };
        ChunkKey::object(path, &node.version, index, self.source.chunk_size())
    }

    fn fetcher(&self, path: &str, node: &Node) -> Arc<dyn Fetcher> {
        self.source.fetcher(&self.info(path, node))
    }

    fn publish(
        &self,
        path: &str,
        staged: &std::path::Path,
        note: UploadNote,
    ) -> BoxFuture<'static, Result<Node, NsError>> {
        let (source, path, staged) = (self.source.clone(), self.key(path), staged.to_path_buf());
        let (part, parallel) = (self.part_size, self.parallel);
        async move { Ok(Self::node(source.upload_file(&path, &staged, part, parallel, note).await?)) }.boxed()
    }

    fn streaming(&self) -> Option<Streaming> {
        Some(Streaming { part: self.part_size as u64, parallel: self.parallel, max_parts: self.source.max_parts() })
    }

    fn begin_upload(&self, path: &str) -> BoxFuture<'static, Result<PartUpload, NsError>> {
        let (source, path) = (self.source.clone(), self.key(path));
        async move { Ok(source.begin_upload(&path).await?) }.boxed()
    }

    fn abort_upload(&self, path: &str, id: &str) -> BoxFuture<'static, Result<(), NsError>> {
        let (source, path, id) = (self.source.clone(), self.key(path), id.to_string());
        async move { Ok(source.abort_upload(&path, &id).await?) }.boxed()
    }

    fn finish_upload(&self, upload: PartUpload) -> BoxFuture<'static, Result<Node, NsError>> {
        async move { Ok(Self::node(upload.complete().await?)) }.boxed()
    }

    fn remove(&self, path: &str) -> BoxFuture<'static, Result<(), NsError>> {
        let (source, path) = (self.source.clone(), self.key(path));
        async move { Ok(source.delete(&path).await?) }.boxed()
    }

    fn remove_all(&self, paths: Vec<String>) -> BoxFuture<'_, Result<(), (String, NsError)>> {
        let keys: Vec<String> = paths.iter().map(|p| self.key(p)).collect();
        async move {
            self.source.delete_many(&keys).await.map_err(|(key, e)| {
                let at = keys.iter().position(|k| *k == key).map(|i| paths[i].clone()).unwrap_or(key);
                (at, NsError::from(e))
            })
        }
        .boxed()
    }

    fn rename(&self, from: &str, known: &Node, to: &str) -> BoxFuture<'static, Result<Node, NsError>> {
        let known = self.info(from, known);
        let (source, from, to) = (self.source.clone(), self.key(from), self.key(to));
        async move { Ok(Self::node(source.rename(&from, &to, &known).await?)) }.boxed()
    }

    fn list_tree(&self, dir: &str) -> BoxFuture<'static, Result<Vec<(String, Node)>, NsError>> {
        let (source, prefix) = (self.source.clone(), format!("{}/", self.key(dir)));
        let root = if self.root.is_empty() { String::new() } else { format!("{}/", self.root) };
        async move {
            let objects = source.list(&prefix).await?;
            Ok(objects
                .into_iter()
                .filter_map(|o| Some((o.path.strip_prefix(&root)?.to_string(), o)))
                // Directory markers are not files; the tree's keys make its directories.
                .filter(|(p, _)| !p.ends_with('/'))
                .map(|(p, o)| (p, Self::node(o)))
                .collect())
        }
        .boxed()
    }

    fn copy(&self, from: &str, listed: &Node, to: &str) -> BoxFuture<'static, Result<Node, NsError>> {
        let known = self.info(from, listed);
        let (source, from, to) = (self.source.clone(), self.key(from), self.key(to));
        async move { Ok(Self::node(source.copy_known(&from, &to, &known).await?)) }.boxed()
    }
}
