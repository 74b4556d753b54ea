//! The peer tier: the nodes' caches made one cluster cache, so that each chunk crosses the
//! origin link (the object store, the registry) about once and then the node network. This
//! module holds who the members are ([`members`]) and which member owns a chunk
//! ([`placement`]).

pub mod members;
pub mod placement;

pub use members::{Member, MemberSource, Members, MembersError, Membership};
pub use placement::{owner_score, rank};
