//! A lazy layer's compressed bytes through the peer tier, so that N nodes starting one image
//! fetch each of its bytes from the registry about once. The blob is cut in fixed segments,
//! each a chunk of the cache keyed by the blob's registry, repository and digest
//! (`registry/<host>/<repository>`, the digest as its version); a segment's owner fetches it
//! from the registry with its own logins and streams it to the members that ask.
//!
//! A manifest, and a small blob (a config), is one chunk keyed by its digest: under the
//! repository's path, with `@manifests` after it for a manifest (no repository name holds an
//! `@`). A tag's digest is a chunk of `@tags/<tag>`, versioned by the TTL period it was
//! resolved in, so that the cluster asks the registry for a tag once per period; what it names
//! is then read by digest, and checked against it.
//!
//! What keeps it safe:
//! - a node asks the registry for a layer's size (a HEAD, with its own logins) before it asks
//!   its peers for any byte of it, its TOC included ([`crate::blob_reads`]);
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

/// What follows a repository's path in the path of its manifests.
const MANIFESTS: &str = "@manifests";
/// What follows a repository's path in the path of a tag.
const TAGS: &str = "@tags/";
/// How long the snapshotter trusts a tag's digest, the periods it resolves tags in: the
/// mirror's default `access_ttl`, so that both share one resolution.
pub const TAG_PERIOD: std::time::Duration = std::time::Duration::from_secs(60);
/// The length of a `sha256:` digest: a tag's chunk.
const DIGEST_LEN: u64 = 71;

/// The path of `image`'s segments.
pub fn segment_path(image: &ImageRef) -> String {
    format!("{PATH_PREFIX}{}/{}", image.host, image.repository)
}

/// The image whose repository a registry path names.
fn image_of(path: &str) -> Result<ImageRef, String> {
    let rest = path.strip_prefix(PATH_PREFIX).ok_or("not a registry path")?;
    let (host, repository) = rest.split_once('/').ok_or("a registry path is registry/<host>/<repository>")?;
    Ok(ImageRef { host: host.to_owned(), repository: repository.to_owned(), tag: None, digest: None })
}

/// An object read whole by its digest.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Whole {
    Manifest,
    /// A blob of at most 1 MiB: a config.
    Blob,
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

    /// Manifest or small blob `digest` of `image` (`size` bytes, for a blob) from this node's
    /// cache, its owner, or the registry; checked against its digest wherever it comes from.
    pub async fn whole(
        &self,
        registry: &Arc<Registry>,
        image: &ImageRef,
        kind: Whole,
        digest: &str,
        size: u64,
    ) -> Result<Bytes, RegistryError> {
        let path = match kind {
            Whole::Blob => segment_path(image),
            Whole::Manifest => format!("{}{MANIFESTS}", segment_path(image)),
        };
        let origin: Arc<dyn Fetcher> =
            Arc::new(WholeFetcher { registry: registry.clone(), image: image.clone(), kind, size });
        let fetcher = self.tier.wrap(origin, size);
        let key = ChunkKey::digest(path, digest);
        self.cache.get(&key, fetcher, GetOptions::default()).await.map_err(|e| RegistryError::Manifest {
            reference: format!("{image}@{digest}"),
            reason: format!("through the peer tier: {e}"),
        })
    }

    /// The digest `tag` of `image` names, as resolved by the tag's owner (or this node) at most
    /// once in each `ttl` period for the cluster.
    pub async fn resolve(
        &self,
        registry: &Arc<Registry>,
        image: &ImageRef,
        tag: &str,
        ttl: std::time::Duration,
    ) -> Result<String, RegistryError> {
        let bad = |reason: String| RegistryError::Manifest { reference: format!("{image}:{tag}"), reason };
        if !is_tag(tag) {
            return Err(bad("not a tag".into()));
        }
        let secs = ttl.as_secs().max(1);
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_secs();
        let key = ChunkKey::object(
            format!("{}{TAGS}{tag}", segment_path(image)),
            format!("period-{secs}s-{}", now / secs),
            0,
            DIGEST_LEN,
        );
        let origin: Arc<dyn Fetcher> =
            Arc::new(TagFetcher { registry: registry.clone(), image: image.clone(), tag: tag.to_owned() });
        let got = self.cache.get(&key, self.tier.wrap(origin, DIGEST_LEN), GetOptions::default()).await;
        let got = got.map_err(|e| bad(format!("through the peer tier: {e}")))?;
        let digest = String::from_utf8_lossy(&got).into_owned();
        if !crate::estargz::is_sha256_digest(&digest) {
            return Err(bad(format!("resolved to {digest:?}, not a sha256 digest")));
        }
        Ok(digest)
    }

    /// The config of `image`'s manifest `manifest` (a digest; an index is resolved to this
    /// platform's manifest), each object read through [`PeerBlobs::whole`] once the registry
    /// has let this node's logins HEAD the manifest.
    pub async fn config(
        &self,
        registry: &Arc<Registry>,
        image: &ImageRef,
        manifest: &str,
    ) -> Result<Bytes, RegistryError> {
        use crate::registry::client::{Decoded, check_config_ref, decode_manifest};
        registry.may_read_manifest(image, manifest).await?;
        let mut digest = manifest.to_owned();
        for _ in 0..2 {
            let body = self.whole(registry, image, Whole::Manifest, &digest, 0).await?;
            match decode_manifest(image, &body, digest.clone())? {
                Decoded::Image(m) => {
                    check_config_ref(image, &m)?;
                    return self.whole(registry, image, Whole::Blob, &m.config_digest, m.config_size).await;
                }
                Decoded::Index { chosen } => digest = chosen,
            }
        }
        Err(RegistryError::Manifest {
            reference: image.to_string(),
            reason: format!("the index names {digest}, which is an index too"),
        })
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

/// A manifest or small blob, whole, from the registry; checked against its digest.
struct WholeFetcher {
    registry: Arc<Registry>,
    image: ImageRef,
    kind: Whole,
    size: u64,
}

impl Fetcher for WholeFetcher {
    fn fetch(&self, key: &ChunkKey) -> BoxFuture<'static, Result<Bytes, FetchError>> {
        let (registry, image, kind, size) = (self.registry.clone(), self.image.clone(), self.kind, self.size);
        let digest = match &key.identity {
            Identity::Digest { digest } => Some(digest.clone()),
            _ => None,
        };
        async move {
            let digest =
                digest.ok_or_else(|| Arc::new(std::io::Error::other("not an object by digest")) as FetchError)?;
            let got = match kind {
                Whole::Manifest => registry.manifest_raw(&image, &digest).await.map(|(body, _)| body),
                Whole::Blob => registry.small_blob(&image, &digest, size).await,
            };
            got.map_err(|e| Arc::new(e) as FetchError)
        }
        .boxed()
    }
}

/// Whether `t` is a tag as the distribution spec has them.
pub fn is_tag(t: &str) -> bool {
    let ok = |c: u8| c.is_ascii_alphanumeric() || b"._-".contains(&c);
    !t.is_empty() && t.len() <= 128 && !t.starts_with(['.', '-']) && t.bytes().all(ok)
}

/// A tag's digest, from the registry.
struct TagFetcher {
    registry: Arc<Registry>,
    image: ImageRef,
    tag: String,
}

impl Fetcher for TagFetcher {
    fn fetch(&self, _key: &ChunkKey) -> BoxFuture<'static, Result<Bytes, FetchError>> {
        let (registry, image, tag) = (self.registry.clone(), self.image.clone(), self.tag.clone());
        async move {
            let digest = registry.resolve_tag(&image, &tag).await.map_err(|e| Arc::new(e) as FetchError)?;
            Ok(Bytes::from(digest))
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
        if let Identity::Digest { digest } = &req.key.identity {
            let (path, kind) = match req.key.path.strip_suffix(MANIFESTS) {
                Some(repository) => (repository, Whole::Manifest),
                None => (req.key.path.as_str(), Whole::Blob),
            };
            if !crate::estargz::is_sha256_digest(digest) {
                return Err(format!("{digest:?} is not a sha256 digest"));
            }
            let image = image_of(path)?;
            let registry = self.registry.clone();
            return Ok(Arc::new(WholeFetcher { registry, image, kind, size: req.size }));
        }
        let Identity::Object { version, chunk_size, .. } = &req.key.identity else {
            return Err("only segments of blobs, manifests and configs are served from the registry".into());
        };
        if let Some((repository, tag)) = req.key.path.split_once(TAGS) {
            if !is_tag(tag) || req.size != DIGEST_LEN || *chunk_size != DIGEST_LEN {
                return Err(format!("{tag:?} is not a tag, or its chunk is not one digest"));
            }
            let (registry, image) = (self.registry.clone(), image_of(repository)?);
            return Ok(Arc::new(TagFetcher { registry, image, tag: tag.to_owned() }));
        }
        if *chunk_size != SEGMENT {
            return Err(format!("segments of {chunk_size} bytes, where this node cuts {SEGMENT}"));
        }
        if req.expected_len().is_none() {
            return Err(format!("the segment lies past the end of the {}-byte blob", req.size));
        }
        let image = image_of(&req.key.path)?;
        if !version.starts_with("sha256:") {
            return Err(format!("{version:?} is not a blob digest"));
        }
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
        assert!(origin.fetcher(&ChunkRequest::new(ChunkKey::digest(&path, &blob), 1000)).is_ok(), "a config");
        let manifests = format!("{path}{MANIFESTS}");
        assert!(origin.fetcher(&ChunkRequest::new(ChunkKey::digest(&manifests, &blob), 0)).is_ok(), "a manifest");
        let tag = |t: &str| ChunkRequest::new(ChunkKey::object(format!("{path}{TAGS}{t}"), "period-60s-1", 0, 71), 71);
        assert!(origin.fetcher(&tag("v1.2_rc-3")).is_ok(), "a tag");
        for t in ["../x", "-x", "a/b", ""] {
            assert!(origin.fetcher(&tag(t)).is_err(), "{t:?} is no tag");
        }
        for (r, why) in [
            (req(&path, &blob, 3, 3 * SEGMENT, SEGMENT), "past the end"),
            (req(&path, &blob, 0, SEGMENT, 4 << 20), "segments of 4194304 bytes"),
            (req(&path, "latest", 0, SEGMENT, SEGMENT), "is not a blob digest"),
            (req("registry/host-only", &blob, 0, SEGMENT, SEGMENT), "registry/<host>/<repository>"),
            (ChunkRequest::new(ChunkKey::digest(&path, "latest"), 0), "is not a sha256 digest"),
            (
                ChunkRequest::new(ChunkKey::digest("registry/host-only@manifests", &blob), 0),
                "registry/<host>/<repository>",
            ),
        ] {
            let e = origin.fetcher(&r).err().unwrap();
            assert!(e.contains(why), "{e}");
        }
    }
}
