//! Metadata through the peer tier: with members, a node asks a path's owner for a directory's
//! listing, a key's stat or a prefix's whole tree before the store, so that the cluster asks
//! the store each once per TTL however many nodes mount it ([`crate::peer::meta`]).

use super::{ObjectInfo, ObjectSource, SourceError};
use crate::peer::MetaFrom;
use crate::peer::meta::{Listed, MetaKind, MetaRequest, millis};
use std::sync::Arc;
use std::time::Duration;

/// One level of a directory (its sub-directories and its objects), and how long ago the store
/// was listed for it.
pub type AgedListing = (Vec<String>, Vec<ObjectInfo>, Duration);

/// What a key is in the store.
#[derive(Debug, Clone, PartialEq)]
pub enum Stat {
    File(ObjectInfo),
    /// Some key lies under `key/`.
    Dir,
    Missing,
}

impl ObjectSource {
    /// As [`ObjectSource::list_dir`], listed at most `max_age` ago (`None`: any age), with its
    /// age: through the directory's owner when the node has peers and the directory is shared.
    pub async fn list_dir_aged(&self, dir: &str, max_age: Option<Duration>) -> Result<AgedListing, SourceError> {
        let req = MetaRequest::list(dir.trim_matches('/'), max_age.unwrap_or(Duration::MAX));
        let (l, age) = self.ask_meta(&req).await?;
        Ok((l.dirs, l.objects, age))
    }

    /// What `key` is (a HEAD, then one key under it), from the store at most `max_age` ago;
    /// an answer that it is missing at most `max_missing_age` ago.
    pub async fn stat_aged(
        &self,
        key: &str,
        max_age: Option<Duration>,
        max_missing_age: Duration,
    ) -> Result<(Stat, Duration), SourceError> {
        let req = MetaRequest {
            kind: MetaKind::Stat,
            path: key.to_owned(),
            max_age_ms: millis(max_age.unwrap_or(Duration::MAX)),
            max_missing_age_ms: Some(millis(max_missing_age)),
        };
        let (mut l, age) = self.ask_meta(&req).await?;
        let stat = match (l.objects.pop(), l.dirs.is_empty()) {
            (Some(o), _) => Stat::File(o),
            (None, false) => Stat::Dir,
            (None, true) => Stat::Missing,
        };
        Ok((stat, age))
    }

    /// As [`ObjectSource::list`] (every object under `prefix`, at any depth), listed at most
    /// `max_age` ago, with its age.
    pub async fn list_aged(&self, prefix: &str, max_age: Duration) -> Result<(Vec<ObjectInfo>, Duration), SourceError> {
        let req = MetaRequest {
            kind: MetaKind::Tree,
            path: prefix.to_owned(),
            max_age_ms: millis(max_age),
            max_missing_age_ms: None,
        };
        let (l, age) = self.ask_meta(&req).await?;
        Ok((l.objects, age))
    }

    async fn ask_meta(&self, req: &MetaRequest) -> Result<(Listed, Duration), SourceError> {
        let tier = self.peers.as_ref().filter(|t| t.shares(&req.shared_as()));
        let from = match tier {
            Some(tier) => tier.ask_meta(req).await,
            None => MetaFrom::Origin,
        };
        let l = match from {
            MetaFrom::Peer(l) => l,
            MetaFrom::Owner => self.listings.answer(self, req).await.map_err(|e| {
                Arc::try_unwrap(e)
                    .unwrap_or_else(|e| SourceError::Listing { dir: req.path.clone(), message: e.to_string() })
            })?,
            MetaFrom::Origin => req.ask_store(self).await?,
        };
        let age = l.at.elapsed();
        Ok((l, age))
    }
}
