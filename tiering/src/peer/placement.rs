//! Which member owns a chunk: weighted rendezvous (highest random weight) hashing of the
//! chunk's content id. Every node computes the same owner from the same member list with no
//! coordination, and a member that joins or leaves moves only its own share of chunks.
//!
//! The hash is fixed, because every node and every release must agree on it: XXH3-64 with
//! seed 0 over the 32 bytes of the chunk's [`KeyId`] followed by the member's name in UTF-8.
//! The hash `h` becomes `u = (h + 0.5) / 2^64` in (0, 1), and a member of weight `w` scores
//! `-w / ln(u)`. The highest score owns the chunk; ties go to the lower name. A chunk's
//! further choices, for failover and for hot chunks, are the members in falling score.

use super::members::Member;
use crate::KeyId;
use xxhash_rust::xxh3::xxh3_64_with_seed;

/// The score of `member` for chunk `id`: the higher, the more it owns the chunk.
pub fn owner_score(id: &KeyId, member: &Member) -> f64 {
    let mut buf = Vec::with_capacity(32 + member.name.len());
    buf.extend_from_slice(&id.0);
    buf.extend_from_slice(member.name.as_bytes());
    let h = xxh3_64_with_seed(&buf, 0);
    // In (0, 1) for every h: 0.5 keeps both ends away from ln(0) and ln(1).
    let u = (h as f64 + 0.5) / 18_446_744_073_709_551_616.0;
    -member.weight / u.ln()
}

/// `members` in the order they are tried for chunk `id`: its owner first.
pub fn rank<'a>(id: &KeyId, members: &'a [Member]) -> Vec<&'a Member> {
    let mut scored: Vec<(f64, &Member)> = members.iter().map(|m| (owner_score(id, m), m)).collect();
    scored.sort_by(|a, b| b.0.total_cmp(&a.0).then_with(|| a.1.name.cmp(&b.1.name)));
    scored.into_iter().map(|(_, m)| m).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ChunkKey;
    use std::collections::HashMap;

    fn member(name: &str, weight: f64) -> Member {
        Member { name: name.to_owned(), weight }
    }

    fn nodes(n: usize) -> Vec<Member> {
        (0..n).map(|i| member(&format!("198.18.0.{}:7470", i + 2), 1.0)).collect()
    }

    fn keys(n: u64) -> Vec<KeyId> {
        (0..n).map(|i| ChunkKey::object("datasets/imagenet/shard-0001.tar", "\"etag\"", i, 4 << 20).id()).collect()
    }

    fn owners<'a>(keys: &[KeyId], members: &'a [Member]) -> Vec<&'a str> {
        keys.iter().map(|k| rank(k, members)[0].name.as_str()).collect()
    }

    /// The hash is part of the cluster's protocol: nodes of different releases must pick the
    /// same owner. These figures were computed once; a change to them is a change of protocol.
    #[test]
    fn the_placement_of_a_chunk_is_fixed_across_releases() {
        let id = ChunkKey::digest("usr/lib/libc.so.6", format!("sha256:{}", "ab".repeat(32))).id();
        let m = member("198.18.0.2:7470", 1.0);
        // XXH3-64 of the empty input, seed 0, as the reference implementation gives it.
        assert_eq!(xxh3_64_with_seed(b"", 0), 0x2d06_8005_38d3_94c2);
        assert_eq!(format!("{:.6}", owner_score(&id, &m)), GOLDEN_SCORE);
        let five = nodes(5);
        let order: Vec<&str> = rank(&id, &five).iter().map(|m| m.name.as_str()).collect();
        assert_eq!(order, GOLDEN_ORDER);
    }

    const GOLDEN_SCORE: &str = "2.442928";
    const GOLDEN_ORDER: [&str; 5] =
        ["198.18.0.3:7470", "198.18.0.4:7470", "198.18.0.2:7470", "198.18.0.5:7470", "198.18.0.6:7470"];

    #[test]
    fn each_member_owns_its_share() {
        let members = nodes(8);
        let ks = keys(16_000);
        let mut count: HashMap<&str, usize> = HashMap::new();
        for o in owners(&ks, &members) {
            *count.entry(o).or_default() += 1;
        }
        assert_eq!(count.len(), 8);
        // 2,000 each on average; a binomial spread of about 42, so 10% off is far out.
        assert!(count.values().all(|&c| (1_800..=2_200).contains(&c)), "{count:?}");
    }

    #[test]
    fn a_member_that_leaves_or_joins_moves_only_its_own_share() {
        let members = nodes(8);
        let ks = keys(8_000);
        let before = owners(&ks, &members);
        let gone = &members[3].name;
        let fewer: Vec<Member> = members.iter().filter(|m| &m.name != gone).cloned().collect();
        let after = owners(&ks, &fewer);
        for (b, a) in before.iter().zip(&after) {
            if b != gone {
                assert_eq!(b, a, "a chunk of a member still there moved");
            }
        }
        let mut more = members.clone();
        more.push(member("198.18.0.99:7470", 1.0));
        let joined = owners(&ks, &more);
        let moved = before.iter().zip(&joined).filter(|(b, j)| b != j).count();
        assert!(joined.iter().zip(&before).all(|(j, b)| j == b || *j == "198.18.0.99:7470"));
        // A ninth of the chunks, about 889, move to the new member, and nothing else moves.
        assert!((750..=1_030).contains(&moved), "{moved} moved");
    }

    #[test]
    fn weights_give_shares_in_proportion_and_order_is_total() {
        let members = vec![member("a:1", 1.0), member("b:1", 3.0)];
        let ks = keys(8_000);
        let big = owners(&ks, &members).iter().filter(|o| **o == "b:1").count();
        assert!((5_700..=6_300).contains(&big), "{big} of 8000 for weight 3 of 4");
        for k in &ks[..50] {
            let order = rank(k, &members);
            assert_eq!(order.len(), 2);
            assert_ne!(order[0].name, order[1].name);
        }
        assert!(rank(&ks[0], &[]).is_empty());
    }
}
