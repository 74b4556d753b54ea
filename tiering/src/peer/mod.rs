//! The peer tier: the nodes' caches made one cluster cache, so that each chunk crosses the
//! origin link (the object store, the registry) about once and then the node network. Who the
//! members are ([`members`]), which one owns a chunk ([`placement`]), how they prove they are
//! members ([`auth`]), what crosses the peer port ([`wire`]), its server ([`server`]) with its
//! bound on hot chunks ([`hot`]), its client ([`client`]) and how long it waits for a member
//! ([`timing`]), and the fetcher that puts the peers before the origin ([`fetcher`]).

pub mod auth;
pub mod client;
pub mod config;
pub mod fetcher;
pub mod hot;
pub mod members;
pub mod meta;
pub mod placement;
pub mod server;
#[cfg(test)]
mod tests;
pub mod timing;
pub mod wire;

pub use config::PeersConfig;
pub use fetcher::{FailoverOptions, MetaFrom, PeerTier, SelfName};
pub use members::{Member, MemberSource, Members, MembersError, Membership};
pub use placement::{owner_score, rank};

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

/// The peer tier's metrics: where this node's chunks came from, and how the members fared.
#[derive(Debug, Default)]
pub struct PeerMetrics {
    /// Chunk bytes this node's misses got from peers.
    pub peer_bytes: Counter,
    /// Chunk bytes this node's misses got from the origin through the peer tier.
    pub origin_bytes: Counter,
    /// Chunk bytes this node served to peers as a chunk's owner (or its stand-in).
    pub served_bytes: Counter,
    /// Chunk bytes this node served to peers an owner sent on to it, from what it held.
    pub holder_served_bytes: Counter,
    /// Askers this node, as an owner sending a hot chunk, sent on to a member that holds it.
    pub redirects: Counter,
    /// Redirects this node followed to a holder.
    pub redirected: Counter,
    /// Transfers that stalled and were resumed at their offset from another member.
    pub resumed: Counter,
    /// Chunks this node was asked for in place of an owner the asker could not reach, and got
    /// from that owner rather than the origin.
    pub stood_in: Counter,
    pub peer_errors: Counter,
    pub peer_timeouts: Counter,
    /// Answers that failed the length, CRC32C or digest check.
    pub peer_corrupt: Counter,
    /// Misses that went to the origin because no member could serve them.
    pub origin_fallbacks: Counter,
    /// Requests to this node's peer port that were not signed with the cluster's secret.
    pub refused: Counter,
    /// Members suspect here now.
    pub suspects: Gauge,
    /// Listings, stats and trees this node got from their owners.
    pub listings_received: Counter,
    /// Listings, stats and trees this node served to members as their owner.
    pub listings_served: Counter,
}

impl PeerMetrics {
    pub fn register(&self, r: &mut Registry) {
        r.register("strata_peer_received_bytes", "Chunk bytes fetched from peers", self.peer_bytes.clone());
        r.register(
            "strata_peer_origin_bytes",
            "Chunk bytes fetched from the origin by the peer tier",
            self.origin_bytes.clone(),
        );
        r.register("strata_peer_served_bytes", "Chunk bytes served to peers as owner", self.served_bytes.clone());
        r.register(
            "strata_peer_holder_served_bytes",
            "Chunk bytes served to peers an owner sent on to this node",
            self.holder_served_bytes.clone(),
        );
        r.register(
            "strata_peer_hot_redirects",
            "Askers of a hot chunk sent on to a member that holds it",
            self.redirects.clone(),
        );
        r.register("strata_peer_redirects_followed", "Hot-chunk redirects followed", self.redirected.clone());
        r.register(
            "strata_peer_resumed",
            "Stalled peer transfers resumed at their offset elsewhere",
            self.resumed.clone(),
        );
        r.register(
            "strata_peer_stood_in",
            "Chunks asked of this node in place of their owner, and got from the owner",
            self.stood_in.clone(),
        );
        r.register("strata_peer_errors", "Peer requests that failed", self.peer_errors.clone());
        r.register("strata_peer_timeouts", "Peer requests that timed out", self.peer_timeouts.clone());
        r.register("strata_peer_corrupt", "Peer answers that failed their check", self.peer_corrupt.clone());
        r.register(
            "strata_peer_origin_fallbacks",
            "Misses sent to the origin because no peer could serve them",
            self.origin_fallbacks.clone(),
        );
        r.register(
            "strata_peer_refused",
            "Peer requests refused for want of the cluster's secret",
            self.refused.clone(),
        );
        r.register("strata_peer_suspect_members", "Members suspect on this node", self.suspects.clone());
        r.register(
            "strata_peer_listings_received",
            "Metadata answers (listings, stats, trees) this node got from their owners",
            self.listings_received.clone(),
        );
        r.register(
            "strata_peer_listings_served",
            "Metadata answers (listings, stats, trees) this node served to members as their owner",
            self.listings_served.clone(),
        );
    }
}
