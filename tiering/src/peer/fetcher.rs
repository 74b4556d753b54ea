//! The peer tier as the cache sees it: a [`Fetcher`] that, on a miss, asks the chunk's owner
//! before the origin. The members are tried in rendezvous order; one that fails is suspect
//! here for a while and is skipped, so that a retry never goes to the same dead member. When
//! this node is the owner, or every member tried failed, the origin is asked, and a fallback
//! is counted and logged, never silent. An owner busy with a hot chunk may name a holder to
//! ask instead; a transfer that stalls is resumed at its offset from the next member.

use super::PeerMetrics;
use super::client::{PeerClient, PeerError};
use super::members::Membership;
use super::meta::{Listed, MetaRequest};
use super::wire::{Ask, ChunkRequest};
use crate::progress::Progress;
use crate::{ChunkKey, FetchError, Fetcher, PathPattern};
use bytes::Bytes;
use futures::FutureExt;
use futures::future::BoxFuture;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tracing::{info, warn};

/// How the tier treats failing members.
#[derive(Debug, Clone, Copy)]
pub struct FailoverOptions {
    /// How long a member that failed is skipped.
    pub suspect_for: Duration,
    /// Members tried for one chunk before the origin is.
    pub tries: usize,
}

/// How this node knows which member it is itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SelfName {
    /// As configured (`peers.advertise`).
    Named(String),
    /// The member whose address is one of this node's, at the port this node serves peers on.
    /// Whether an address is this node's is told by binding a socket to it: nothing is sent.
    Detect { port: u16 },
    /// This node asks peers but is not one of the members.
    NotMember,
}

impl SelfName {
    fn is(&self, member: &str) -> bool {
        match self {
            SelfName::Named(n) => n == member,
            SelfName::Detect { port } => member
                .parse::<std::net::SocketAddr>()
                .is_ok_and(|a| a.port() == *port && std::net::UdpSocket::bind((a.ip(), 0)).is_ok()),
            SelfName::NotMember => false,
        }
    }
}

/// Why and until when a member is skipped.
#[derive(Debug, Clone, Copy)]
struct Suspicion {
    until: Instant,
    /// For a member that was only late: since when, so that word from it lifts the suspicion.
    lifted_by_word: Option<tokio::time::Instant>,
}

/// This node's view of the peer tier.
#[derive(Debug)]
pub struct PeerTier {
    me: SelfName,
    /// What [`SelfName::is`] said of each member seen.
    is_me: Mutex<HashMap<String, bool>>,
    membership: Membership,
    client: PeerClient,
    failover: FailoverOptions,
    suspects: Mutex<HashMap<String, Suspicion>>,
    metrics: Arc<PeerMetrics>,
    /// Set while fetches fall back to the origin, so that a run of them is logged once.
    falling_back: AtomicBool,
    /// Paths whose chunks never go to peers.
    not_shared: Vec<PathPattern>,
}

impl PeerTier {
    pub fn new(
        me: SelfName,
        membership: Membership,
        client: PeerClient,
        failover: FailoverOptions,
        metrics: Arc<PeerMetrics>,
        not_shared: Vec<PathPattern>,
    ) -> Arc<PeerTier> {
        Arc::new(PeerTier {
            me,
            is_me: Mutex::new(HashMap::new()),
            membership,
            client,
            failover,
            suspects: Mutex::new(HashMap::new()),
            metrics,
            falling_back: AtomicBool::new(false),
            not_shared,
        })
    }

    /// Whether chunks of `path` may go to peers at all.
    pub fn shares(&self, path: &str) -> bool {
        !self.not_shared.iter().any(|p| p.matches(path))
    }

    /// `origin`, the fetcher of an object of `size` bytes, with the peer tier before it.
    pub fn wrap(self: &Arc<Self>, origin: Arc<dyn Fetcher>, size: u64) -> Arc<dyn Fetcher> {
        Arc::new(PeerFetcher { tier: self.clone(), origin, size })
    }

    pub fn metrics(&self) -> &PeerMetrics {
        &self.metrics
    }

    /// The metrics, to share with the peer port's server.
    pub fn metrics_handle(&self) -> Arc<PeerMetrics> {
        self.metrics.clone()
    }

    /// The members now, each with whether it is suspect here.
    pub fn members(&self) -> Vec<(String, bool)> {
        self.membership.current().list().iter().map(|m| (m.name.clone(), self.is_suspect(&m.name))).collect()
    }

    /// Whether `member` is this node.
    pub fn is_self(&self, member: &str) -> bool {
        let mut seen = self.is_me.lock().unwrap_or_else(|p| p.into_inner());
        *seen.entry(member.to_owned()).or_insert_with(|| self.me.is(member))
    }

    /// This node's name among `members`, if it is one of them.
    fn own_name(&self, members: &super::Members) -> Option<String> {
        members.list().iter().find(|m| self.is_self(&m.name)).map(|m| m.name.clone())
    }

    fn is_suspect(&self, member: &str) -> bool {
        let mut s = self.suspects.lock().unwrap_or_else(|p| p.into_inner());
        match s.get(member) {
            Some(Suspicion { lifted_by_word: Some(since), .. }) if self.client.heard_since(member, *since) => {}
            Some(Suspicion { until, .. }) if *until > Instant::now() => return true,
            Some(_) => {}
            None => return false,
        }
        s.remove(member);
        self.metrics.suspects.set(s.len() as i64);
        false
    }

    /// Marks `member` suspect for the configured time; one that only answered late (a
    /// timeout on a connection that was made, a stall) is trusted again as soon as it is
    /// heard from, since a member slow on a saturated node is not a dead one.
    fn suspect(&self, member: &str, e: &PeerError) {
        let slow = matches!(e, PeerError::Stalled { .. })
            || matches!(e, PeerError::Timeout { waiting_for, .. } if *waiting_for != "connection");
        let lifted_by_word = slow.then(tokio::time::Instant::now);
        self.insert_suspect(member, Suspicion { until: Instant::now() + self.failover.suspect_for, lifted_by_word });
    }

    fn insert_suspect(&self, member: &str, suspicion: Suspicion) {
        let mut s = self.suspects.lock().unwrap_or_else(|p| p.into_inner());
        s.insert(member.to_owned(), suspicion);
        self.metrics.suspects.set(s.len() as i64);
    }

    /// Marks `member` suspect, as a member that failed outright.
    #[cfg(test)]
    pub(super) fn mark_suspect(&self, member: &str) {
        self.insert_suspect(
            member,
            Suspicion { until: Instant::now() + self.failover.suspect_for, lifted_by_word: None },
        );
    }

    /// The chunk from the members, in rendezvous order: `None` when this node should fetch it
    /// from the origin itself (it is the first choice not suspect, or all tried failed).
    async fn ask_peers(&self, req: &ChunkRequest, progress: &Progress) -> Option<Bytes> {
        let members = self.membership.current();
        if members.is_empty() {
            return None;
        }
        let me = self.own_name(&members);
        // Bytes from a transfer that stalled, which the next member is asked to go on from.
        let mut have = Bytes::new();
        let mut tried = 0;
        for m in members.rank(&req.key.id()) {
            if self.is_self(&m.name) {
                // This node owns the chunk (or stands in for the owners before it).
                self.falling_back.store(false, Ordering::Relaxed);
                return None;
            }
            if self.is_suspect(&m.name) {
                continue;
            }
            if tried == self.failover.tries {
                break;
            }
            tried += 1;
            let ask = ChunkRequest { from: me.clone(), start: have.len() as u64, ..req.clone() };
            if !have.is_empty() {
                self.metrics.resumed.inc();
            }
            match self.ask_owner(&m.name, &ask, &have, me.as_deref(), progress).await {
                Ok(bytes) => {
                    self.metrics.peer_bytes.inc_by(bytes.len() as u64);
                    if self.falling_back.swap(false, Ordering::Relaxed) {
                        info!(member = %m.name, "peers answer again");
                    }
                    return Some(bytes);
                }
                Err(e) => {
                    self.failed(&m.name, &e);
                    if let PeerError::Stalled { got, .. } = &e {
                        let mut joined = have.to_vec();
                        joined.extend_from_slice(got);
                        have = joined.into();
                    }
                    if e.is_origin_failure() {
                        // Asked again here, once, rather than of the next member's origin too.
                        warn!(chunk = %req.key, error = %e, "the owner's origin fetch failed; asking the origin");
                        break;
                    }
                    warn!(chunk = %req.key, error = %e, "peer failed; trying the next choice");
                }
            }
        }
        self.metrics.origin_fallbacks.inc();
        if !self.falling_back.swap(true, Ordering::Relaxed) {
            warn!(chunk = %req.key, tried, "no peer could serve a chunk; fetching from the origin until one can");
        }
        None
    }

    /// The chunk from `owner`, or from the holder it names when it is sending the chunk to
    /// enough members already; should that holder fail, from the owner after all.
    async fn ask_owner(
        &self,
        owner: &str,
        req: &ChunkRequest,
        have: &Bytes,
        me: Option<&str>,
        progress: &Progress,
    ) -> Result<Bytes, PeerError> {
        let to = match self.client.get_chunk(owner, req, have, Some(progress)).await {
            Err(PeerError::Redirect { to, .. }) => to,
            other => return other,
        };
        if Some(to.as_str()) != me && !self.is_suspect(&to) {
            self.metrics.redirected.inc();
            let holder = ChunkRequest { ask: Ask::Holder, ..req.clone() };
            match self.client.get_chunk(&to, &holder, have, Some(progress)).await {
                Ok(bytes) => return Ok(bytes),
                Err(e) => {
                    self.failed(&to, &e);
                    info!(chunk = %req.key, holder = %to, error = %e, "the holder an owner named failed; asking the owner");
                }
            }
        }
        self.client.get_chunk(owner, &ChunkRequest { ask: Ask::Direct, ..req.clone() }, have, Some(progress)).await
    }

    /// The fetcher this node serves chunk `req` with when a member asks it: `origin`, unless
    /// this node is standing in for the chunk's owner. The asker could not reach the owner in
    /// time, but this node may: an owner that is slow, not dead, already has the chunk or is
    /// fetching it, so this node asks it once before it fetches from the origin a second time.
    /// The owner itself never forwards, so a chunk crosses two hops at most.
    pub fn serving(self: &Arc<Self>, origin: Arc<dyn Fetcher>, req: &ChunkRequest) -> Arc<dyn Fetcher> {
        let members = self.membership.current();
        let owner = members.rank(&req.key.id()).into_iter().next().map(|m| m.name.clone());
        match owner {
            Some(owner) if !self.is_self(&owner) && req.from.as_ref() != Some(&owner) && self.shares(&req.key.path) => {
                Arc::new(StandIn { tier: self.clone(), origin, owner, size: req.size })
            }
            _ => origin,
        }
    }

    /// Where the metadata `req` asks for comes from: its owner's answer, this node as the
    /// owner, or the store itself when every member tried failed (counted and logged once a
    /// run, as chunks are).
    pub async fn ask_meta(&self, req: &MetaRequest) -> MetaFrom {
        let members = self.membership.current();
        if members.is_empty() {
            return MetaFrom::Origin;
        }
        let mut tried = 0;
        for m in members.rank(&req.placement()) {
            if self.is_self(&m.name) {
                return MetaFrom::Owner;
            }
            if self.is_suspect(&m.name) {
                continue;
            }
            if tried == self.failover.tries {
                break;
            }
            tried += 1;
            match self.client.get_meta(&m.name, req).await {
                Ok(answer) => {
                    self.metrics.listings_received.inc();
                    return MetaFrom::Peer(Listed::from_answer(answer));
                }
                Err(e) => {
                    self.failed(&m.name, &e);
                    if e.is_origin_failure() {
                        warn!(path = %req.path, kind = ?req.kind, error = %e, "the owner failed to ask the store; asking it here");
                        break;
                    }
                    warn!(path = %req.path, kind = ?req.kind, error = %e, "peer failed a metadata ask; trying the next choice");
                }
            }
        }
        self.metrics.origin_fallbacks.inc();
        if !self.falling_back.swap(true, Ordering::Relaxed) {
            warn!(path = %req.path, tried, "no peer could answer for metadata; asking the store until one can");
        }
        MetaFrom::Origin
    }

    /// Counts a failed request to `member`, and marks the member suspect if it is to blame.
    fn failed(&self, member: &str, e: &PeerError) {
        self.metrics.peer_errors.inc();
        match e {
            PeerError::Timeout { .. } | PeerError::Stalled { .. } => {
                self.metrics.peer_timeouts.inc();
            }
            PeerError::Corrupt { .. } => {
                self.metrics.peer_corrupt.inc();
            }
            _ => {}
        }
        if e.blames_member() {
            self.suspect(member, e);
        }
    }
}

/// Where a listing, a stat or a tree comes from.
#[derive(Debug)]
pub enum MetaFrom {
    Peer(Listed),
    /// This node owns the path: it asks the store through its own
    /// [`super::meta::MetaCache`], which the members' asks share.
    Owner,
    Origin,
}

struct PeerFetcher {
    tier: Arc<PeerTier>,
    origin: Arc<dyn Fetcher>,
    size: u64,
}

impl Fetcher for PeerFetcher {
    fn fetch(&self, key: &ChunkKey) -> BoxFuture<'static, Result<Bytes, FetchError>> {
        self.fetch_streaming(key, Progress::default())
    }

    fn fetch_streaming(&self, key: &ChunkKey, progress: Progress) -> BoxFuture<'static, Result<Bytes, FetchError>> {
        let (tier, origin) = (self.tier.clone(), self.origin.clone());
        let req = ChunkRequest::new(key.clone(), self.size);
        async move {
            // Only fetchers wrapped for the peer tier come here: an object's chunks, and a
            // registry's segments, manifests and configs, which members fetch for each other.
            if tier.shares(&req.key.path)
                && let Some(bytes) = tier.ask_peers(&req, &progress).await
            {
                return Ok(bytes);
            }
            let bytes = origin.fetch_streaming(&req.key, progress).await?;
            tier.metrics.origin_bytes.inc_by(bytes.len() as u64);
            Ok(bytes)
        }
        .boxed()
    }
}

/// The fetcher of a member standing in for `owner`: the owner first, unless it is suspect
/// here, then the origin.
struct StandIn {
    tier: Arc<PeerTier>,
    origin: Arc<dyn Fetcher>,
    owner: String,
    size: u64,
}

impl Fetcher for StandIn {
    fn fetch(&self, key: &ChunkKey) -> BoxFuture<'static, Result<Bytes, FetchError>> {
        self.fetch_streaming(key, Progress::default())
    }

    fn fetch_streaming(&self, key: &ChunkKey, progress: Progress) -> BoxFuture<'static, Result<Bytes, FetchError>> {
        let (tier, origin, owner) = (self.tier.clone(), self.origin.clone(), self.owner.clone());
        let req = ChunkRequest::new(key.clone(), self.size);
        async move {
            if !tier.is_suspect(&owner) {
                let me = tier.own_name(&tier.membership.current());
                let ask = ChunkRequest { from: me.clone(), ..req.clone() };
                match tier.ask_owner(&owner, &ask, &Bytes::new(), me.as_deref(), &progress).await {
                    Ok(bytes) => {
                        tier.metrics.stood_in.inc();
                        tier.metrics.peer_bytes.inc_by(bytes.len() as u64);
                        return Ok(bytes);
                    }
                    Err(e) => {
                        tier.failed(&owner, &e);
                        warn!(chunk = %req.key, error = %e, "standing in for an owner that failed here too; asking the origin");
                    }
                }
            }
            let bytes = origin.fetch_streaming(&req.key, progress).await?;
            tier.metrics.origin_bytes.inc_by(bytes.len() as u64);
            Ok(bytes)
        }
        .boxed()
    }
}
