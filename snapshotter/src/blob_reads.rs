//! Where a layer's TOC, and a layer fetched whole, are read from: the registry, or the peer
//! tier's segments of the blob ([`crate::peer_blobs`]), so that N nodes starting one image ask
//! the registry for each TOC about once. Before a node reads a byte of a blob from its peers,
//! it asks the registry for the blob's size (a HEAD, with its own logins): its peers never give
//! it a layer the registry would not.

use crate::peer_blobs::PeerBlobs;
use crate::registry::range_stream::{RangeStream, collect, collect_seen};
use crate::registry::{ImageRef, Registry, RegistryError};
use bytes::Bytes;
use std::ops::Range;
use std::sync::Arc;

#[derive(Debug, Clone, Copy)]
pub enum BlobReads<'a> {
    Registry(&'a Registry),
    /// The blob's segments through the peer tier; `size` is what the registry said.
    Peers {
        registry: &'a Arc<Registry>,
        peers: &'a PeerBlobs,
        size: u64,
    },
}

impl<'a> BlobReads<'a> {
    /// Blob `digest` of `image` through `peers` when they share the image, else from the
    /// registry.
    pub async fn for_blob(
        registry: &'a Arc<Registry>,
        peers: Option<&'a PeerBlobs>,
        image: &ImageRef,
        digest: &str,
    ) -> Result<BlobReads<'a>, RegistryError> {
        match peers.filter(|p| p.shares(image)) {
            Some(peers) => Ok(BlobReads::Peers { registry, peers, size: registry.blob_size(image, digest).await? }),
            None => Ok(BlobReads::Registry(registry)),
        }
    }

    /// As [`Registry::blob_tail`].
    pub async fn tail(
        &self,
        image: &ImageRef,
        digest: &str,
        len: u64,
        observe: impl FnMut(&[u8]) + Send,
    ) -> Result<(Bytes, u64), RegistryError> {
        match *self {
            BlobReads::Registry(r) => r.blob_tail(image, digest, len, observe).await,
            BlobReads::Peers { size, .. } => {
                let start = size.saturating_sub(len);
                Ok((collect_seen(self.range_stream(image, digest, start..size).await?, observe).await?, size))
            }
        }
    }

    /// As [`Registry::blob_from`].
    pub async fn from(
        &self,
        image: &ImageRef,
        digest: &str,
        start: u64,
        limit: u64,
    ) -> Result<(Bytes, u64), RegistryError> {
        match *self {
            BlobReads::Registry(r) => r.blob_from(image, digest, start, limit).await,
            BlobReads::Peers { size, .. } if start >= size || size - start > limit => Err(RegistryError::Blob {
                url: format!("{image}@{digest}"),
                reason: format!("bytes {start}- of a {size}-byte blob are not a tail of at most {limit} bytes"),
            }),
            BlobReads::Peers { size, .. } => {
                Ok((collect(self.range_stream(image, digest, start..size).await?).await?, size))
            }
        }
    }

    /// As [`Registry::blob_range_stream`].
    pub async fn range_stream(
        &self,
        image: &ImageRef,
        digest: &str,
        range: Range<u64>,
    ) -> Result<RangeStream, RegistryError> {
        match *self {
            BlobReads::Registry(r) => r.blob_range_stream(image, digest, range).await,
            BlobReads::Peers { registry, peers, size } => Ok(peers.range_stream(registry, image, digest, size, range)),
        }
    }

    /// As [`Registry::blob_to_file`]. Through the peer tier, a blob that fails its digest has
    /// its segments dropped from this node's cache, and is fetched from the registry itself,
    /// as is one the peer tier cannot give.
    pub async fn to_file(&self, image: &ImageRef, digest: &str, out: &mut std::fs::File) -> Result<u64, RegistryError> {
        let (registry, peers, size) = match *self {
            BlobReads::Registry(r) => return r.blob_to_file(image, digest, out).await,
            BlobReads::Peers { registry, peers, size } => (registry, peers, size),
        };
        if size > 0 {
            match self.stream_to_file(image, digest, size, out).await {
                Ok(()) => return Ok(size),
                Err(e) => {
                    tracing::warn!(%image, blob = digest, error = %e, "the peer tier could not give a whole layer; fetching it from the registry");
                    peers.forget(image, digest, 0..size).await;
                }
            }
            use std::io::Seek;
            let reset = out.set_len(0).and_then(|()| out.rewind());
            reset.map_err(|e| RegistryError::Blob {
                url: format!("{image}@{digest}"),
                reason: format!("writing the blob: {e}"),
            })?;
        }
        registry.blob_to_file(image, digest, out).await
    }

    async fn stream_to_file(
        &self,
        image: &ImageRef,
        digest: &str,
        size: u64,
        out: &mut std::fs::File,
    ) -> Result<(), RegistryError> {
        use sha2::{Digest as _, Sha256};
        use std::io::Write;
        let fail =
            |reason: String| RegistryError::Blob { url: format!("{image}@{digest} through the peer tier"), reason };
        let mut stream = self.range_stream(image, digest, 0..size).await?;
        let mut hash = Sha256::new();
        while let Some(piece) = stream.next().await? {
            hash.update(&piece);
            out.write_all(&piece).map_err(|e| fail(format!("writing the blob: {e}")))?;
        }
        let actual = format!("sha256:{}", hex::encode(hash.finalize()));
        if actual != digest {
            return Err(fail(format!("the blob's bytes hash to {actual}, not {digest}")));
        }
        Ok(())
    }
}
