//! What crosses the peer port: `GET /strata/v1/chunk?k=KEY` over HTTP/2, where KEY is the
//! chunk's request in base64url JSON (its [`ChunkKey`], the size of the object it is cut
//! from, who asks, from which byte, and of whom), signed as [`super::auth`] says. The answer
//! starts at once, before the chunk is fetched, so that an asker tells a live member from a
//! stopped one within a short timeout. Its body is the chunk's bytes from that byte on, and its
//! trailers hold the CRC32C of the whole chunk, which the requester checks before it keeps a
//! byte; or, should the fetch fail after the answer started, the status and the reason. An
//! owner sending the chunk to as many members as it will at once answers `307` instead, with
//! the name of a member that holds it or is receiving it now.

use crate::ChunkKey;
use base64::Engine;
use serde::{Deserialize, Serialize};

pub const CHUNK_PATH: &str = "/strata/v1/chunk";
/// The trailer with the CRC32C of the whole chunk, in hex.
pub const CRC_TRAILER: &str = "x-strata-crc32c";
/// The trailers of an answer whose fetch failed after it started: the status it would have
/// had (400, 404 or 502), and why.
pub const STATUS_TRAILER: &str = "x-strata-status";
pub const ERROR_TRAILER: &str = "x-strata-error";
/// The header of a `307` answer: the member to ask instead, in [`Ask::Holder`] mode.
pub const HOLDER_HEADER: &str = "x-strata-peer-holder";

/// What the asked member is asked to be.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Ask {
    /// The chunk's owner: it fetches from the origin when it must, and may send the asker on
    /// to a member that holds the chunk when it is sending it to enough members already.
    #[default]
    Owner,
    /// The owner, after a member it sent the asker to could not serve: it does not redirect.
    Direct,
    /// A member the owner named: it serves the chunk only if it holds it or is receiving it.
    Holder,
}

/// A chunk asked of a peer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChunkRequest {
    pub key: ChunkKey,
    /// The size of the object the chunk is cut from: the last chunk is shorter.
    pub size: u64,
    /// The asker's member name, so that an owner can send later askers to it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from: Option<String>,
    /// The first byte wanted: the asker holds the ones before it from a stream that stalled.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub start: u64,
    #[serde(default, skip_serializing_if = "is_owner")]
    pub ask: Ask,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

fn is_owner(a: &Ask) -> bool {
    *a == Ask::Owner
}

impl ChunkRequest {
    /// The whole chunk `key`, of an object of `size` bytes, asked of its owner.
    pub fn new(key: ChunkKey, size: u64) -> ChunkRequest {
        ChunkRequest { key, size, from: None, start: 0, ask: Ask::Owner }
    }

    /// The path and query of the request.
    pub fn path_and_query(&self) -> String {
        let json = serde_json::to_vec(self).expect("a chunk request serialises");
        format!("{CHUNK_PATH}?k={}", base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(json))
    }

    /// The request in the query `query` (without its `?`).
    pub fn from_query(query: &str) -> Result<ChunkRequest, String> {
        let k = query.strip_prefix("k=").ok_or("no k= in the query")?;
        let json = base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(k)
            .map_err(|e| format!("k is not base64url: {e}"))?;
        serde_json::from_slice(&json).map_err(|e| format!("k is not a chunk request: {e}"))
    }

    /// How many bytes the chunk holds, if its key is of a chunk of an object.
    pub fn expected_len(&self) -> Option<u64> {
        match &self.key.identity {
            crate::Identity::Object { index, chunk_size, .. } => {
                let offset = index.checked_mul(*chunk_size)?;
                (offset < self.size || (offset == 0 && self.size == 0)).then(|| (*chunk_size).min(self.size - offset))
            }
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_crosses_the_wire_unchanged_and_knows_its_length() {
        let r = ChunkRequest::new(ChunkKey::object("ds/a b?#.bin", "\"e1\"", 2, 4 << 20), (8 << 20) + 5);
        let pq = r.path_and_query();
        let (path, query) = pq.split_once('?').unwrap();
        assert_eq!(path, CHUNK_PATH);
        assert!(query.bytes().all(|b| b.is_ascii_alphanumeric() || b"=-_".contains(&b)), "{query}");
        assert_eq!(ChunkRequest::from_query(query).unwrap(), r);
        assert_eq!(r.expected_len(), Some(5));
        let resumed = ChunkRequest { from: Some("198.18.0.2:7470".into()), start: 3, ask: Ask::Holder, ..r.clone() };
        let q = resumed.path_and_query();
        assert_eq!(ChunkRequest::from_query(q.split_once('?').unwrap().1).unwrap(), resumed);
        assert!(q.len() > pq.len(), "the defaults are left out of the plain request");
        let past = ChunkRequest { size: 8 << 20, ..r.clone() };
        assert_eq!(past.expected_len(), None, "a chunk past the object's end");
        assert!(ChunkRequest::from_query("k=@@").unwrap_err().contains("base64url"));
        assert!(ChunkRequest::from_query("x=1").is_err());
    }
}
