//! Cluster-wide metadata: each directory of the cold store that a dataset mount lists has a
//! rendezvous owner, as chunks do. A node asks the owner before the store; the owner lists the
//! directory once however many nodes ask at the same time, and answers from that listing while
//! it is younger than the asker allows. Every answer carries its age, so that the asker's own
//! cache expires it when the listing would have expired had the asker made it itself: a node
//! never sees an entry older than its mount's TTL promises.

use crate::KeyId;
use crate::source::{ObjectInfo, ObjectSource, SourceError};
use base64::Engine;
use futures::FutureExt;
use futures::future::{BoxFuture, Shared};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub const META_PATH: &str = "/strata/v1/meta";

/// What is asked of a directory's owner: one level of the `/`-delimited tree under `dir`,
/// no older than `max_age_ms`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MetaRequest {
    pub dir: String,
    pub max_age_ms: u64,
}

impl MetaRequest {
    pub fn path_and_query(&self) -> String {
        let json = serde_json::to_vec(self).expect("a metadata request serialises");
        format!("{META_PATH}?k={}", base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(json))
    }

    pub fn from_query(query: &str) -> Result<MetaRequest, String> {
        let k = query.strip_prefix("k=").ok_or("no k= in the query")?;
        let json = base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(k)
            .map_err(|e| format!("k is not base64url: {e}"))?;
        serde_json::from_slice(&json).map_err(|e| format!("k is not a metadata request: {e}"))
    }

    /// Where the directory's owner is placed: SHA-256 of the kind and the directory, so that
    /// every node and every release agree.
    pub fn placement(dir: &str) -> KeyId {
        let mut h = Sha256::new();
        h.update(b"strata-meta-list\0");
        h.update(dir.as_bytes());
        KeyId(h.finalize().into())
    }
}

/// A directory's listing as it crosses the peer port.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MetaAnswer {
    pub dirs: Vec<String>,
    pub objects: Vec<ObjectInfo>,
    /// How long ago the owner listed it.
    pub age_ms: u64,
}

/// One listing, and when it was made.
#[derive(Debug, Clone)]
pub struct Listed {
    pub dirs: Vec<String>,
    pub objects: Vec<ObjectInfo>,
    pub at: Instant,
}

impl Listed {
    pub fn answer(&self) -> MetaAnswer {
        MetaAnswer {
            dirs: self.dirs.clone(),
            objects: self.objects.clone(),
            age_ms: self.at.elapsed().as_millis() as u64,
        }
    }

    pub fn from_answer(a: MetaAnswer) -> Listed {
        let age = Duration::from_millis(a.age_ms);
        let at = Instant::now().checked_sub(age).unwrap_or_else(Instant::now);
        Listed { dirs: a.dirs, objects: a.objects, at }
    }
}

type Listing = Shared<BoxFuture<'static, Result<Listed, Arc<SourceError>>>>;

/// The listings this node made as the owner of their directories: each kept while some asker
/// may still take it, and one listing in flight per directory, which every asker waits on.
#[derive(Debug, Default)]
pub struct MetaCache {
    listed: Mutex<HashMap<String, Listed>>,
    inflight: Mutex<HashMap<String, Listing>>,
}

/// Listings kept at most: past it, the oldest half goes.
const KEPT: usize = 50_000;

impl MetaCache {
    /// Directory `dir` of `source`, listed at most `max_age` ago.
    pub async fn list(&self, source: &ObjectSource, dir: &str, max_age: Duration) -> Result<Listed, Arc<SourceError>> {
        if let Some(l) = self.listed.lock().unwrap_or_else(|p| p.into_inner()).get(dir)
            && l.at.elapsed() <= max_age
        {
            return Ok(l.clone());
        }
        let flight = {
            let mut inflight = self.inflight.lock().unwrap_or_else(|p| p.into_inner());
            inflight
                .entry(dir.to_owned())
                .or_insert_with(|| {
                    let (source, d) = (source.clone(), dir.to_owned());
                    async move {
                        let at = Instant::now();
                        let (dirs, objects) = source.list_dir(&d).await.map_err(Arc::new)?;
                        Ok(Listed { dirs, objects, at })
                    }
                    .boxed()
                    .shared()
                })
                .clone()
        };
        let got = flight.await;
        // Kept before the flight is let go: an asker coming in between finds one or the other,
        // and never lists the directory again.
        if let Ok(l) = &got {
            let mut listed = self.listed.lock().unwrap_or_else(|p| p.into_inner());
            if listed.len() >= KEPT {
                let mut ages: Vec<Instant> = listed.values().map(|l| l.at).collect();
                ages.sort_unstable();
                let cut = ages[ages.len() / 2];
                listed.retain(|_, l| l.at > cut);
            }
            listed.insert(dir.to_owned(), l.clone());
        }
        self.inflight.lock().unwrap_or_else(|p| p.into_inner()).remove(dir);
        got
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::SystemTime;

    #[test]
    fn a_request_and_an_answer_cross_the_wire_unchanged() {
        let r = MetaRequest { dir: "datasets/a b?#".into(), max_age_ms: 60_000 };
        let pq = r.path_and_query();
        assert_eq!(MetaRequest::from_query(pq.split_once('?').unwrap().1).unwrap(), r);
        assert_ne!(MetaRequest::placement("a"), MetaRequest::placement("b"));
        let o = ObjectInfo {
            path: "datasets/x".into(),
            size: 5,
            version: "\"e\"".into(),
            modified: SystemTime::UNIX_EPOCH + Duration::new(1_700_000_000, 42),
        };
        let l =
            Listed { dirs: vec!["sub".into()], objects: vec![o.clone()], at: Instant::now() - Duration::from_secs(3) };
        let a = l.answer();
        assert!((3000..3500).contains(&a.age_ms), "{}", a.age_ms);
        let back = Listed::from_answer(serde_json::from_slice(&serde_json::to_vec(&a).unwrap()).unwrap());
        assert_eq!((back.dirs, back.objects), (vec!["sub".to_string()], vec![o]));
        assert!(back.at.elapsed() >= Duration::from_secs(3), "the age carries over");
    }
}
