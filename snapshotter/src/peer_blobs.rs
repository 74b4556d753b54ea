//! A lazy layer's compressed bytes through the peer tier, so that N nodes starting one image
//! fetch each of its bytes from the registry about once. The blob is cut in fixed segments,
//! each a chunk of the cache keyed by the blob's registry, repository and digest
//! (`registry/<host>/<repository>`, the digest as its version); a segment's owner fetches it
//! from the registry with its own logins and streams it to the members that ask.
//!
//! What keeps it safe:
//! - a layer's TOC is always read from the registry itself, so a node asks its peers for a
//!   layer's bytes only once its own logins have read from that blob;
//! - a segment is checked by its CRC32C from the owner, and every chunk decoded from segments
//!   by its digest from the TOC, before a byte is cached or served: a segment under a chunk
//!   that fails is dropped, and the chunk is fetched from the registry itself.

use crate::registry::range_stream::RangeStream;
use crate::registry::{ImageRef, Registry, RegistryError};
use bytes::Bytes;
use futures::future::BoxFuture;
use futures::{FutureExt, StreamExt};
use std::ops::Range;
use std::sync::Arc;
use strata_tiering::peer::PeerTier;
use strata_tiering::peer::server::Origin;
use strata_tiering::peer::wire::ChunkRequest;
use strata_tiering::{ChunkKey, FetchError, Fetcher, GetOptions, Identity, TieredCache};

/// The size of a blob's segments: every node must cut them the same.
pub const SEGMENT: u64 = 1 << 20;
/// The start of every segment's path, which the peer port sends to the registry's origin.
pub const PATH_PREFIX: &str = "registry/";
/// Segments of one range fetched at once.
const PARALLEL: usize = 4;
/// How far a range is read ahead of its reader.
const AHEAD: usize = 4 << 20;

/// The path of `image`'s segments.
pub fn segment_path(image: &ImageRef) -> String {
    format!("{PATH_PREFIX}{}/{}", image.host, image.repository)
}

/// Blobs through the peer tier, into this node's cache.
#[derive(Debug)]
pub struct PeerBlobs {
    cache: TieredCache,
    tier: Arc<PeerTier>,
}

impl PeerBlobs {
    pub fn new(cache: TieredCache, tier: Arc<PeerTier>) -> PeerBlobs {
        PeerBlobs { cache, tier }
    }

    /// Whether `image`'s layers go through the peer tier (`peers.not_shared` may say not).
    pub fn shares(&self, image: &ImageRef) -> bool {
        self.tier.shares(&segment_path(image))
    }

    fn key(image: &ImageRef, digest: &str, index: u64) -> ChunkKey {
        ChunkKey::object(segment_path(image), digest, index, SEGMENT)
    }

    /// Bytes `range` of blob `digest` (of `size` bytes) of `image`, segment by segment from
    /// this node's cache, the segment's owner, or the registry.
    pub fn range_stream(
        &self,
        registry: &Arc<Registry>,
        image: &ImageRef,
        digest: &str,
        size: u64,
        range: Range<u64>,
    ) -> RangeStream {
        let source = format!("{}@{digest} through the peer tier", segment_path(image));
        let origin: Arc<dyn Fetcher> = Arc::new(SegmentFetcher {
            registry: registry.clone(),
            image: image.clone(),
            digest: digest.to_owned(),
            size,
        });
        let fetcher = self.tier.wrap(origin, size);
        let (cache, image, digest, why) = (self.cache.clone(), image.clone(), digest.to_owned(), source.clone());
        let first = range.start / SEGMENT;
        let last = range.end.saturating_sub(1) / SEGMENT;
        let wanted = range.clone();
        let pieces = futures::stream::iter(first..=last)
            .map(move |i| {
                let (cache, fetcher, key, why) =
                    (cache.clone(), fetcher.clone(), Self::key(&image, &digest, i), why.clone());
                async move {
                    let segment = cache
                        .get(&key, fetcher, GetOptions::default())
                        .await
                        .map_err(|e| RegistryError::Blob { url: why, reason: e.to_string() })?;
                    Ok::<_, RegistryError>((i * SEGMENT, segment))
                }
            })
            .buffered(PARALLEL)
            .map(move |got| {
                let (at, segment) = got?;
                let from = wanted.start.max(at) - at;
                let to = (wanted.end.min(at + segment.len() as u64) - at).max(from);
                Ok(segment.slice(from as usize..to as usize))
            });
        RangeStream::from_pieces(source, range, pieces, AHEAD)
    }

    /// Drops the segments under `range` of blob `digest` from this node's cache: a chunk
    /// decoded from them failed its digest.
    pub async fn forget(&self, image: &ImageRef, digest: &str, range: Range<u64>) {
        let keys: Vec<ChunkKey> = (range.start / SEGMENT..=range.end.saturating_sub(1) / SEGMENT)
            .map(|i| Self::key(image, digest, i))
            .collect();
        if let Err(e) = self.cache.discard(keys).await {
            tracing::warn!(layer = digest, error = %e, "could not drop the segments under a chunk that failed its digest");
        }
    }
}

/// One segment of a blob, from the registry.
struct SegmentFetcher {
    registry: Arc<Registry>,
    image: ImageRef,
    digest: String,
    size: u64,
}

impl Fetcher for SegmentFetcher {
    fn fetch(&self, key: &ChunkKey) -> BoxFuture<'static, Result<Bytes, FetchError>> {
        let (registry, image, digest, size) =
            (self.registry.clone(), self.image.clone(), self.digest.clone(), self.size);
        let index = match &key.identity {
            Identity::Object { index, .. } => Some(*index),
            _ => None,
        };
        async move {
            let index =
                index.ok_or_else(|| Arc::new(std::io::Error::other("not a segment of a blob")) as FetchError)?;
            let start = index * SEGMENT;
            let range = start..(start + SEGMENT).min(size);
            registry.blob_range(&image, &digest, range).await.map_err(|e| Arc::new(e) as FetchError)
        }
        .boxed()
    }
}

/// The peer port's origin for blob segments: this node's registry client, with its own logins.
/// A node that cannot pull the image answers that it cannot, and the asker pulls it itself.
#[derive(Debug)]
pub struct RegistryOrigin {
    pub registry: Arc<Registry>,
}

impl Origin for RegistryOrigin {
    fn fetcher(&self, req: &ChunkRequest) -> Result<Arc<dyn Fetcher>, String> {
        let Identity::Object { version, chunk_size, .. } = &req.key.identity else {
            return Err("only segments of blobs are served from the registry".into());
        };
        if *chunk_size != SEGMENT {
            return Err(format!("segments of {chunk_size} bytes, where this node cuts {SEGMENT}"));
        }
        if req.expected_len().is_none() {
            return Err(format!("the segment lies past the end of the {}-byte blob", req.size));
        }
        let rest = req.key.path.strip_prefix(PATH_PREFIX).ok_or("not a registry path")?;
        let (host, repository) = rest.split_once('/').ok_or("a registry path is registry/<host>/<repository>")?;
        if !version.starts_with("sha256:") {
            return Err(format!("{version:?} is not a blob digest"));
        }
        let image = ImageRef { host: host.to_owned(), repository: repository.to_owned(), tag: None, digest: None };
        Ok(Arc::new(SegmentFetcher { registry: self.registry.clone(), image, digest: version.clone(), size: req.size }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_segment_request_names_its_registry_repository_and_blob() {
        let image = ImageRef::parse(
            "198.18.0.1:5000/team/train@sha256:0000000000000000000000000000000000000000000000000000000000000000",
        )
        .unwrap();
        let blob = format!("sha256:{}", "ab".repeat(32));
        let origin = RegistryOrigin {
            registry: Arc::new(Registry::new(
                crate::registry::hosts::Hosts::new(None),
                crate::registry::auth::Credentials::default(),
            )),
        };
        let req = |path: &str, version: &str, index: u64, size: u64, cut: u64| {
            ChunkRequest::new(ChunkKey::object(path, version, index, cut), size)
        };
        let path = segment_path(&image);
        assert_eq!(path, "registry/198.18.0.1:5000/team/train");
        assert!(origin.fetcher(&req(&path, &blob, 2, 3 * SEGMENT - 1, SEGMENT)).is_ok());
        for (r, why) in [
            (req(&path, &blob, 3, 3 * SEGMENT, SEGMENT), "past the end"),
            (req(&path, &blob, 0, SEGMENT, 4 << 20), "segments of 4194304 bytes"),
            (req(&path, "latest", 0, SEGMENT, SEGMENT), "is not a blob digest"),
            (req("registry/host-only", &blob, 0, SEGMENT, SEGMENT), "registry/<host>/<repository>"),
            (ChunkRequest::new(ChunkKey::digest(&path, &blob), SEGMENT), "only segments of blobs"),
        ] {
            let e = origin.fetcher(&r).err().unwrap();
            assert!(e.contains(why), "{e}");
        }
    }
}
