//! Cluster-wide metadata: each directory of the cold store that a dataset mount lists, each key
//! it looks up on its own (a HEAD) and each prefix it snapshots whole has a rendezvous owner, as
//! chunks do. A node asks the owner before the store; the owner asks the store once however many
//! nodes ask at the same time, and answers from that one answer while it is younger than the
//! asker allows. Every answer carries its age, so that the asker's own cache expires it when it
//! would have expired had the asker asked the store itself: a node never sees an entry older
//! than its mount's TTL promises.

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

/// What is asked about a path.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MetaKind {
    /// One level of the `/`-delimited tree under the directory `path`.
    #[default]
    List,
    /// What `path` is: an object (its HEAD), a directory (some key under `path/`), or nothing.
    Stat,
    /// Every object whose key starts with `path`, at any depth: a namespace snapshot.
    Tree,
}

/// What is asked of a path's owner, no older than `max_age_ms`; an answer that the path is
/// missing, no older than `max_missing_age_ms` (the asker's negative TTL) when that is set.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MetaRequest {
    #[serde(default)]
    pub kind: MetaKind,
    #[serde(alias = "dir")]
    pub path: String,
    pub max_age_ms: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_missing_age_ms: Option<u64>,
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

    /// A listing of directory `dir`, no older than `max_age`.
    pub fn list(dir: &str, max_age: Duration) -> MetaRequest {
        MetaRequest {
            kind: MetaKind::List,
            path: dir.to_owned(),
            max_age_ms: millis(max_age),
            max_missing_age_ms: None,
        }
    }

    /// Where the path's owner is placed: SHA-256 of the kind and the path, so that every node
    /// and every release agree.
    pub fn placement(&self) -> KeyId {
        let mut h = Sha256::new();
        h.update(match self.kind {
            MetaKind::List => b"strata-meta-list\0",
            MetaKind::Stat => b"strata-meta-stat\0",
            MetaKind::Tree => b"strata-meta-tree\0",
        });
        h.update(self.path.as_bytes());
        KeyId(h.finalize().into())
    }

    /// The path as `peers.not_shared` patterns match it: a directory's keys are under `dir/`.
    pub fn shared_as(&self) -> String {
        match self.kind {
            MetaKind::List => format!("{}/", self.path),
            MetaKind::Stat | MetaKind::Tree => self.path.clone(),
        }
    }

    /// Whether `l`, an answer to this kind of request, is young enough for it.
    fn takes(&self, l: &Listed) -> bool {
        let age = l.at.elapsed();
        let missing = self.kind == MetaKind::Stat && l.dirs.is_empty() && l.objects.is_empty();
        age <= Duration::from_millis(self.max_age_ms)
            && !(missing && self.max_missing_age_ms.is_some_and(|m| age > Duration::from_millis(m)))
    }

    /// Asks the store itself.
    pub async fn ask_store(&self, source: &ObjectSource) -> Result<Listed, SourceError> {
        let at = Instant::now();
        let (dirs, objects) = match self.kind {
            MetaKind::List => source.list_dir(&self.path).await?,
            MetaKind::Tree => (Vec::new(), source.list(&self.path).await?),
            MetaKind::Stat => match source.head(&self.path).await {
                Ok(o) => (Vec::new(), vec![o]),
                Err(e) if e.is_not_found() => {
                    let dir = source.exists_under(&self.path).await?;
                    (if dir { vec![String::new()] } else { Vec::new() }, Vec::new())
                }
                Err(e) => return Err(e),
            },
        };
        Ok(Listed { dirs, objects, at })
    }
}

/// Milliseconds, `Duration::MAX` as "any age".
pub fn millis(d: Duration) -> u64 {
    d.as_millis().min(u64::MAX as u128) as u64
}

/// An answer as it crosses the peer port: a directory's listing; a stat's object, or `[""]` in
/// `dirs` for a directory, or neither for nothing; a tree's objects.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MetaAnswer {
    pub dirs: Vec<String>,
    pub objects: Vec<ObjectInfo>,
    /// How long ago the owner listed it.
    pub age_ms: u64,
}

/// One answer of the store, and when it was made.
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

type Flight = Shared<BoxFuture<'static, Result<Listed, Arc<SourceError>>>>;
type Asked = (MetaKind, String);

/// The answers this node got from the store as the owner of their paths: each kept while some
/// asker may still take it, and one request in flight per path, which every asker waits on.
#[derive(Debug, Default)]
pub struct MetaCache {
    listed: Mutex<HashMap<Asked, Listed>>,
    inflight: Mutex<HashMap<Asked, Flight>>,
}

/// Answers kept at most (a job start stats every file of a dataset): past it, the oldest half
/// goes.
const KEPT: usize = 200_000;

impl MetaCache {
    /// The answer to `req` about `source`, from the store at most `req.max_age_ms` ago.
    pub async fn answer(&self, source: &ObjectSource, req: &MetaRequest) -> Result<Listed, Arc<SourceError>> {
        let asked: Asked = (req.kind, req.path.clone());
        if let Some(l) = self.listed.lock().unwrap_or_else(|p| p.into_inner()).get(&asked)
            && req.takes(l)
        {
            return Ok(l.clone());
        }
        let flight = {
            let mut inflight = self.inflight.lock().unwrap_or_else(|p| p.into_inner());
            inflight
                .entry(asked.clone())
                .or_insert_with(|| {
                    let (source, req) = (source.clone(), req.clone());
                    async move { req.ask_store(&source).await.map_err(Arc::new) }.boxed().shared()
                })
                .clone()
        };
        let got = flight.await;
        // Kept before the flight is let go: an asker coming in between finds one or the other,
        // and never asks the store again.
        if let Ok(l) = &got {
            let mut listed = self.listed.lock().unwrap_or_else(|p| p.into_inner());
            if listed.len() >= KEPT {
                let mut ages: Vec<Instant> = listed.values().map(|l| l.at).collect();
                ages.sort_unstable();
                let cut = ages[ages.len() / 2];
                listed.retain(|_, l| l.at > cut);
            }
            listed.insert(asked.clone(), l.clone());
        }
        self.inflight.lock().unwrap_or_else(|p| p.into_inner()).remove(&asked);
        got
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::SystemTime;

    #[test]
    fn a_request_and_an_answer_cross_the_wire_unchanged() {
        let r = MetaRequest::list("datasets/a b?#", Duration::from_secs(60));
        let pq = r.path_and_query();
        assert_eq!(MetaRequest::from_query(pq.split_once('?').unwrap().1).unwrap(), r);
        let stat = MetaRequest { kind: MetaKind::Stat, max_missing_age_ms: Some(5000), ..r.clone() };
        assert_eq!(MetaRequest::from_query(stat.path_and_query().split_once('?').unwrap().1).unwrap(), stat);
        assert_ne!(
            MetaRequest::list("a", Duration::ZERO).placement(),
            MetaRequest::list("b", Duration::ZERO).placement()
        );
        assert_ne!(stat.placement(), r.placement(), "a path's listing and its stat are placed apart");
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

    #[test]
    fn a_missing_answer_is_taken_only_within_the_negative_ttl() {
        let stat =
            MetaRequest { kind: MetaKind::Stat, path: "k".into(), max_age_ms: 60_000, max_missing_age_ms: Some(5_000) };
        let aged = |secs| Instant::now() - Duration::from_secs(secs);
        let missing = Listed { dirs: vec![], objects: vec![], at: aged(10) };
        let dir = Listed { dirs: vec![String::new()], objects: vec![], at: aged(10) };
        assert!(!stat.takes(&missing), "a 10 s old 'missing' is past a 5 s negative TTL");
        assert!(stat.takes(&dir), "a 10 s old directory is within the 60 s TTL");
        assert!(stat.takes(&Listed { at: aged(1), ..missing.clone() }));
        assert!(!stat.takes(&Listed { at: aged(61), ..dir }));
        let list = MetaRequest { kind: MetaKind::List, ..stat };
        assert!(list.takes(&missing), "an empty directory's listing is not a missing name");
    }
}
