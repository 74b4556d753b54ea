//! How peers know each other: a secret every member of the cluster holds, read from a file
//! (a Kubernetes Secret, say). A request carries an HMAC-SHA256 of its method, its path with
//! its query, and the time it was made, so the secret never crosses the network. The server
//! takes a request only within a few minutes of its time, and compares in constant time.

use hmac::{Hmac, Mac};
use sha2::Sha256;
use std::path::Path;

/// The request header that carries `UNIX-SECONDS:HEX-HMAC`.
pub const AUTH_HEADER: &str = "x-strata-peer-auth";
/// How far a request's time may be from the server's clock.
const MAX_SKEW_SECS: u64 = 300;
/// The shortest secret taken: 32 bytes, as `openssl rand -hex 16` gives.
const MIN_SECRET: usize = 32;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum AuthError {
    #[error("the peer secret in {path} is {len} bytes; at least {MIN_SECRET} are needed")]
    Short { path: String, len: usize },
    #[error("the peer secret in {path} cannot be read: {reason}")]
    Unreadable { path: String, reason: String },
    #[error("no {AUTH_HEADER} header")]
    Missing,
    #[error("the {AUTH_HEADER} header is not SECONDS:HMAC")]
    Malformed,
    #[error("the request's time is {skew} s from this node's, more than {MAX_SKEW_SECS}")]
    Skew { skew: u64 },
    #[error("the request is not signed with this cluster's peer secret")]
    Wrong,
}

/// The cluster's peer secret.
#[derive(Clone)]
pub struct PeerSecret(Vec<u8>);

impl std::fmt::Debug for PeerSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PeerSecret(..)")
    }
}

impl PeerSecret {
    /// The secret in `path`, without a trailing newline.
    pub fn from_file(path: &Path) -> Result<PeerSecret, AuthError> {
        let shown = path.display().to_string();
        let bytes =
            std::fs::read(path).map_err(|e| AuthError::Unreadable { path: shown.clone(), reason: e.to_string() })?;
        let trimmed = bytes.trim_ascii_end();
        if trimmed.len() < MIN_SECRET {
            return Err(AuthError::Short { path: shown, len: trimmed.len() });
        }
        Ok(PeerSecret(trimmed.to_vec()))
    }

    fn mac(&self, method: &str, path_and_query: &str, secs: u64) -> Hmac<Sha256> {
        let mut mac = Hmac::<Sha256>::new_from_slice(&self.0).expect("HMAC takes a key of any length");
        mac.update(method.as_bytes());
        mac.update(b"\n");
        mac.update(path_and_query.as_bytes());
        mac.update(b"\n");
        mac.update(secs.to_string().as_bytes());
        mac
    }

    /// The header value for a request made at `secs`.
    pub fn sign(&self, method: &str, path_and_query: &str, secs: u64) -> String {
        format!("{secs}:{}", hex::encode(self.mac(method, path_and_query, secs).finalize().into_bytes()))
    }

    /// Whether `header` signs this request, at `now` by the server's clock.
    pub fn verify(&self, header: Option<&str>, method: &str, path_and_query: &str, now: u64) -> Result<(), AuthError> {
        let (secs, tag) = header.ok_or(AuthError::Missing)?.split_once(':').ok_or(AuthError::Malformed)?;
        let secs: u64 = secs.parse().map_err(|_| AuthError::Malformed)?;
        let tag = hex::decode(tag).map_err(|_| AuthError::Malformed)?;
        let skew = now.abs_diff(secs);
        if skew > MAX_SKEW_SECS {
            return Err(AuthError::Skew { skew });
        }
        // verify_slice compares in constant time.
        self.mac(method, path_and_query, secs).verify_slice(&tag).map_err(|_| AuthError::Wrong)
    }
}

/// Seconds since the epoch, by this node's clock.
pub fn now_secs() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

#[cfg(test)]
pub(crate) fn test_secret(byte: u8) -> PeerSecret {
    PeerSecret(vec![byte; MIN_SECRET])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_is_taken_only_signed_with_the_secret_and_in_time() {
        let s = test_secret(7);
        let h = s.sign("GET", "/strata/v1/chunk?k=abc", 1_000_000);
        assert_eq!(s.verify(Some(&h), "GET", "/strata/v1/chunk?k=abc", 1_000_100), Ok(()));
        assert_eq!(s.verify(Some(&h), "GET", "/strata/v1/chunk?k=abd", 1_000_000), Err(AuthError::Wrong));
        assert_eq!(test_secret(8).verify(Some(&h), "GET", "/strata/v1/chunk?k=abc", 1_000_000), Err(AuthError::Wrong));
        assert_eq!(s.verify(Some(&h), "GET", "/strata/v1/chunk?k=abc", 1_000_301), Err(AuthError::Skew { skew: 301 }));
        assert_eq!(s.verify(None, "GET", "/", 0), Err(AuthError::Missing));
        assert_eq!(s.verify(Some("nope"), "GET", "/", 0), Err(AuthError::Malformed));
        assert_eq!(s.verify(Some("5:zz"), "GET", "/", 5), Err(AuthError::Malformed));
    }

    #[test]
    fn a_short_or_missing_secret_file_is_refused_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("secret");
        std::fs::write(&path, "short\n").unwrap();
        let e = PeerSecret::from_file(&path).unwrap_err().to_string();
        assert_eq!(e, format!("the peer secret in {} is 5 bytes; at least 32 are needed", path.display()));
        std::fs::write(&path, format!("{}\n", "ab".repeat(16))).unwrap();
        let s = PeerSecret::from_file(&path).unwrap();
        assert_eq!(s.0.len(), 32, "the newline is not part of it");
        assert!(PeerSecret::from_file(&dir.path().join("none")).unwrap_err().to_string().contains("cannot be read"));
    }
}
