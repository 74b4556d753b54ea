//! Content identity of a cached chunk.
//!
//! A chunk is named by what its bytes *are*, never by where they sit: an object version plus a
//! chunk index, or a content digest. Every key also carries the logical path that policy rules,
//! pins and the CLI match against.

use serde::{Deserialize, Serialize};
use sha2::{Digest as _, Sha256};
use std::fmt;

/// What makes the bytes of a chunk unique.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Identity {
    /// Chunk `index` of one version (ETag or version id) of an object, cut at `chunk_size`.
    Object { version: String, index: u64, chunk_size: u64 },
    /// Bytes whose digest (e.g. `sha256:...`) is known up front. Equal digests share one entry,
    /// whatever path they were reached through.
    Digest { digest: String },
    /// A whole object version as one contiguous file without a header, assembled from verified
    /// chunks so the kernel can read it directly (FUSE passthrough). Derived data: it is never
    /// moved between tiers, and a restart discards it.
    File { version: String, size: u64 },
}

/// A chunk key: the identity plus the logical path used for policy matching.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ChunkKey {
    pub path: String,
    pub identity: Identity,
}

impl ChunkKey {
    pub fn object(path: impl Into<String>, version: impl Into<String>, index: u64, chunk_size: u64) -> Self {
        ChunkKey { path: path.into(), identity: Identity::Object { version: version.into(), index, chunk_size } }
    }

    pub fn whole(path: impl Into<String>, version: impl Into<String>, size: u64) -> Self {
        ChunkKey { path: path.into(), identity: Identity::File { version: version.into(), size } }
    }

    pub fn is_whole(&self) -> bool {
        matches!(self.identity, Identity::File { .. })
    }

    pub fn digest(path: impl Into<String>, digest: impl Into<String>) -> Self {
        ChunkKey { path: path.into(), identity: Identity::Digest { digest: digest.into() } }
    }

    /// Hashes what names an object's content: the kind, its path and its version.
    fn hash_named(&self, h: &mut Sha256, kind: &[u8], version: &str) {
        h.update(kind);
        h.update(self.path.as_bytes());
        h.update(b"\0");
        h.update(version.as_bytes());
        h.update(b"\0");
    }

    /// The stable id that names the chunk's file in every tier.
    pub fn id(&self) -> KeyId {
        let mut h = Sha256::new();
        match &self.identity {
            Identity::Object { version, index, chunk_size } => {
                self.hash_named(&mut h, b"object\0", version);
                h.update(chunk_size.to_le_bytes());
                h.update(index.to_le_bytes());
            }
            Identity::File { version, size } => {
                self.hash_named(&mut h, b"file\0", version);
                h.update(size.to_le_bytes());
            }
            // The path is left out on purpose so identical chunks dedup across layers and images.
            Identity::Digest { digest } => {
                h.update(b"digest\0");
                h.update(digest.as_bytes());
            }
        }
        KeyId(h.finalize().into())
    }
}

impl fmt::Display for ChunkKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.identity {
            Identity::Object { version, index, .. } => write!(f, "{}@{}#{}", self.path, version, index),
            Identity::Digest { digest } => write!(f, "{} ({digest})", self.path),
            Identity::File { version, .. } => write!(f, "{}@{} (whole)", self.path, version),
        }
    }
}

/// SHA-256 of a key's canonical form.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct KeyId(pub [u8; 32]);

impl KeyId {
    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }

    pub fn from_hex(s: &str) -> Option<Self> {
        let mut out = [0u8; 32];
        hex::decode_to_slice(s, &mut out).ok()?;
        Some(KeyId(out))
    }
}

impl fmt::Debug for KeyId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "KeyId({})", &self.to_hex()[..16])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn object_ids_differ_by_version_and_index() {
        let a = ChunkKey::object("d/a.bin", "e1", 0, 1 << 20);
        assert_eq!(a.id(), ChunkKey::object("d/a.bin", "e1", 0, 1 << 20).id());
        assert_ne!(a.id(), ChunkKey::object("d/a.bin", "e2", 0, 1 << 20).id());
        assert_ne!(a.id(), ChunkKey::object("d/a.bin", "e1", 1, 1 << 20).id());
        assert_ne!(a.id(), ChunkKey::object("d/a.bin", "e1", 0, 4 << 20).id());
    }

    #[test]
    fn digest_ids_ignore_the_path() {
        let a = ChunkKey::digest("img1/layer/x", "sha256:ab");
        let b = ChunkKey::digest("img2/layer/y", "sha256:ab");
        assert_eq!(a.id(), b.id());
    }

    #[test]
    fn hex_round_trip() {
        let id = ChunkKey::digest("p", "sha256:00").id();
        assert_eq!(KeyId::from_hex(&id.to_hex()), Some(id));
        assert_eq!(KeyId::from_hex("zz"), None);
    }
}
