//! What the cache reads a miss through: a fetcher, which may tell of the bytes as they arrive,
//! and the form a streamed read takes.

use crate::error::{CacheError, FetchError};
use crate::key::ChunkKey;
use crate::progress::{Progress, Tail};
use bytes::Bytes;
use futures::future::BoxFuture;

/// Produces the bytes of a chunk on a miss: a ranged GET, a registry fetch, anything. The bytes
/// it returns must already be verified as far as the source allows; the cache checksums them
/// from then on.
pub trait Fetcher: Send + Sync + 'static {
    fn fetch(&self, key: &ChunkKey) -> BoxFuture<'static, Result<Bytes, FetchError>>;

    /// As [`Fetcher::fetch`], telling `progress` of the bytes as they arrive, for readers that
    /// pass them on before the chunk is whole. A fetcher that cannot tell leaves it alone; its
    /// readers get the chunk when it is whole.
    fn fetch_streaming(&self, key: &ChunkKey, progress: Progress) -> BoxFuture<'static, Result<Bytes, FetchError>> {
        let _ = progress;
        self.fetch(key)
    }
}

/// A chunk as [`TieredCache::stream`] gives it.
pub enum Streamed {
    /// A local tier held it.
    Whole(Bytes),
    /// It is being fetched: its pieces as they arrive, unchecked, and then the fetcher's answer.
    Arriving { tail: Tail, answer: BoxFuture<'static, Result<Bytes, CacheError>> },
}

impl std::fmt::Debug for Streamed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Streamed::Whole(b) => write!(f, "Whole({} bytes)", b.len()),
            Streamed::Arriving { .. } => f.write_str("Arriving"),
        }
    }
}
