//! Directory listings through the peer tier: with members, a node asks a directory's owner
//! for its listing before the store, so that the cluster lists each directory once per TTL
//! however many nodes mount it ([`crate::peer::meta`]).

use super::{ObjectInfo, ObjectSource, SourceError};
use crate::peer::ListingFrom;
use crate::peer::meta::MetaRequest;
use std::sync::Arc;
use std::time::Duration;

/// One level of a directory (its sub-directories and its objects), and how long ago the store
/// was listed for it.
pub type AgedListing = (Vec<String>, Vec<ObjectInfo>, Duration);

impl ObjectSource {
    /// As [`ObjectSource::list_dir`], listed at most `max_age` ago (`None`: any age), with its
    /// age: through the directory's owner when the node has peers and the directory is shared.
    pub async fn list_dir_aged(&self, dir: &str, max_age: Option<Duration>) -> Result<AgedListing, SourceError> {
        let dir = dir.trim_matches('/');
        let tier = self.peers.as_ref().filter(|t| t.shares(&format!("{dir}/")));
        let Some(tier) = tier else {
            let (dirs, objects) = self.list_dir(dir).await?;
            return Ok((dirs, objects, Duration::ZERO));
        };
        let max_age = max_age.unwrap_or(Duration::MAX);
        let req = MetaRequest { dir: dir.to_owned(), max_age_ms: max_age.as_millis().min(u64::MAX as u128) as u64 };
        match tier.ask_listing(&req).await {
            ListingFrom::Peer(l) => Ok((l.dirs, l.objects, l.at.elapsed())),
            ListingFrom::Owner => match self.listings.list(self, dir, max_age).await {
                Ok(l) => Ok((l.dirs, l.objects, l.at.elapsed())),
                Err(e) => Err(Arc::try_unwrap(e)
                    .unwrap_or_else(|e| SourceError::Listing { dir: dir.to_owned(), message: e.to_string() })),
            },
            ListingFrom::Origin => {
                let (dirs, objects) = self.list_dir(dir).await?;
                Ok((dirs, objects, Duration::ZERO))
            }
        }
    }
}
