//! The dataset namespace: a bucket prefix (or local directory) whose `/`-delimited keys become
//! directories, served by ranged GETs keyed by ETag.

use crate::namespace::{Namespace, Node, NodeKind, NsError};
use futures::FutureExt;
use futures::future::BoxFuture;
use std::sync::Arc;
use std::time::SystemTime;
use strata_tiering::source::{ObjectInfo, ObjectSource};
use strata_tiering::{ChunkKey, Fetcher};

#[derive(Debug, Clone)]
pub struct ObjectNamespace {
    source: ObjectSource,
}

impl ObjectNamespace {
    pub fn new(source: ObjectSource) -> Self {
        ObjectNamespace { source }
    }

    fn info(path: &str, node: &Node) -> ObjectInfo {
        ObjectInfo { path: path.to_string(), size: node.size, version: node.version.clone(), modified: node.mtime }
    }
}

impl Namespace for ObjectNamespace {
    fn describe(&self) -> String {
        self.source.describe().to_string()
    }

    fn read_dir(&self, dir: &str) -> BoxFuture<'static, Result<Vec<Node>, NsError>> {
        let source = self.source.clone();
        let dir = dir.to_string();
        async move {
            let (dirs, objects) = source.list_dir(&dir).await?;
            let mut out: Vec<Node> = dirs
                .into_iter()
                .map(|name| Node {
                    name,
                    kind: NodeKind::Dir,
                    size: 0,
                    version: String::new(),
                    mtime: SystemTime::UNIX_EPOCH,
                })
                .collect();
            for o in objects {
                let name = o.path.rsplit('/').next().unwrap_or(&o.path).to_string();
                // A key ending in `/` is a directory marker some tools create; it is not a file.
                if name.is_empty() {
                    continue;
                }
                out.push(Node { name, kind: NodeKind::File, size: o.size, version: o.version, mtime: o.modified });
            }
            Ok(out)
        }
        .boxed()
    }

    fn chunk_size(&self) -> u64 {
        self.source.chunk_size()
    }

    fn chunk_key(&self, path: &str, node: &Node, index: u64) -> ChunkKey {
        ChunkKey::object(path, &node.version, index, self.source.chunk_size())
    }

    fn fetcher(&self, path: &str, node: &Node) -> Arc<dyn Fetcher> {
        self.source.fetcher(&Self::info(path, node))
    }
}
