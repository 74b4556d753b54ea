//! Bounded load for hot chunks. When every node wants one chunk at once (an image's prefetch
//! region, the first shard of an epoch, a checkpoint restore), its owner sends it to at most
//! `fanout` members at a time, and sends each further asker to a member it has already
//! admitted or redirected: that member holds the chunk, or is receiving it now and joins the
//! asker to its own transfer. So the members that got the chunk first serve the next ones, a
//! tree that grows as askers arrive, and the owner's link carries `fanout` copies, not N.

use crate::KeyId;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// What the owner does with one asker.
#[derive(Debug)]
pub enum Admission {
    /// Send it the chunk; the transfer counts against the bound until the guard drops.
    Send(SendGuard),
    /// Send it to this member instead.
    Redirect(String),
}

#[derive(Debug, Default)]
struct Hot {
    sending: usize,
    /// Members that were sent the chunk, or sent on to one that was, in the order they came.
    holders: Vec<String>,
    /// Which holder the next redirect names, so that redirects spread over all of them.
    next: usize,
}

/// The chunks this node is sending now, and to whom.
#[derive(Debug, Clone)]
pub struct HotChunks {
    fanout: usize,
    chunks: Arc<Mutex<HashMap<KeyId, Hot>>>,
}

impl HotChunks {
    pub fn new(fanout: usize) -> HotChunks {
        HotChunks { fanout: fanout.max(1), chunks: Arc::default() }
    }

    /// Admits asker `from` to chunk `id`, or names a holder for it when the chunk is being sent
    /// to `fanout` members already and `may_redirect`.
    pub fn admit(&self, id: KeyId, from: Option<&str>, may_redirect: bool) -> Admission {
        let mut chunks = self.chunks.lock().unwrap_or_else(|p| p.into_inner());
        let hot = chunks.entry(id).or_default();
        let remember = |hot: &mut Hot| {
            if let Some(f) = from
                && !hot.holders.iter().any(|h| h == f)
            {
                hot.holders.push(f.to_owned());
            }
        };
        if may_redirect && hot.sending >= self.fanout {
            let others: Vec<&String> = hot.holders.iter().filter(|h| Some(h.as_str()) != from).collect();
            if !others.is_empty() {
                let to = others[hot.next % others.len()].clone();
                hot.next += 1;
                remember(hot);
                return Admission::Redirect(to);
            }
        }
        hot.sending += 1;
        remember(hot);
        Admission::Send(SendGuard { chunks: self.chunks.clone(), id })
    }
}

/// One transfer of a chunk to a member. When the last one ends the chunk is no longer hot,
/// and its holders are forgotten: the owner then has it cached and sends it to whoever asks.
#[derive(Debug)]
pub struct SendGuard {
    chunks: Arc<Mutex<HashMap<KeyId, Hot>>>,
    id: KeyId,
}

impl Drop for SendGuard {
    fn drop(&mut self) {
        let mut chunks = self.chunks.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(hot) = chunks.get_mut(&self.id) {
            hot.sending -= 1;
            if hot.sending == 0 {
                chunks.remove(&self.id);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(n: u8) -> KeyId {
        crate::ChunkKey::object("p", "v", n as u64, 1).id()
    }

    fn to(a: Admission) -> Option<String> {
        match a {
            Admission::Send(_) => None,
            Admission::Redirect(m) => Some(m),
        }
    }

    #[test]
    fn past_the_fanout_askers_go_to_earlier_ones_in_turn() {
        let hot = HotChunks::new(2);
        let a = hot.admit(id(1), Some("a"), true);
        let b = hot.admit(id(1), Some("b"), true);
        assert!(matches!((&a, &b), (Admission::Send(_), Admission::Send(_))));
        assert_eq!(to(hot.admit(id(1), Some("c"), true)).as_deref(), Some("a"));
        assert_eq!(to(hot.admit(id(1), Some("d"), true)).as_deref(), Some("b"));
        assert_eq!(to(hot.admit(id(1), Some("e"), true)).as_deref(), Some("c"), "a redirected asker serves too");
        assert_eq!(to(hot.admit(id(1), Some("a"), true)).as_deref(), Some("e"), "never sent to itself");
        let direct = hot.admit(id(1), Some("f"), false);
        assert!(matches!(direct, Admission::Send(_)), "a direct ask is always sent");
        assert!(matches!(hot.admit(id(2), Some("c"), true), Admission::Send(_)), "another chunk is not hot");
        drop((a, b, direct));
        assert!(matches!(hot.admit(id(1), Some("g"), true), Admission::Send(_)), "sent to all: no longer hot");
    }

    #[test]
    fn an_asker_with_no_name_is_sent_the_chunk_when_no_one_holds_it() {
        let hot = HotChunks::new(1);
        let _a = hot.admit(id(1), None, true);
        assert!(matches!(hot.admit(id(1), None, true), Admission::Send(_)), "no holder to name yet");
        let _b = hot.admit(id(1), Some("b"), false);
        assert_eq!(to(hot.admit(id(1), None, true)).as_deref(), Some("b"));
    }
}
