//! The peer tier across three `strata daemon`s, each in a network namespace of its own on a
//! Linux bridge, against the real Ceph RGW that `.ci/run` starts (reached through a relay on
//! the bridge that adds a round trip's delay, since RGW listens on loopback). What a platform
//! team counts on: each chunk crosses from RGW once however many nodes read it, as RGW's own
//! log shows; a chunk all nodes want at once is sent on by its first receivers rather than all
//! by its owner; a killed owner is survived with the right bytes and still one fetch per chunk;
//! a member whose bytes are changed on the wire is caught and skipped; and the peer port
//! refuses a request without the cluster's secret.

mod common;

use common::netns::{Back, Net, relay};
use common::s3::delete_under;
use common::*;
use object_store::ObjectStoreExt;
use sha2::{Digest, Sha256};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

const NODES: usize = 3;
const CHUNK: usize = 1 << 20;
const PEER_PORT: u16 = 7470;
/// Where the other nodes reach node 1: a relay on the bridge that can change its bytes.
const NODE1_VIA: &str = "198.18.0.1:7471";

fn node(i: usize, net: &Net, rgw: &Rgw, secret: &std::path::Path) -> Daemon {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("admin.sock");
    let config = dir.path().join("config.toml");
    let name = |j: usize| if j == 1 { NODE1_VIA.to_owned() } else { format!("{}:{PEER_PORT}", Net::addr(j)) };
    let members: Vec<String> = (0..NODES).map(|j| format!("\"{}\"", name(j))).collect();
    let port = rgw.endpoint.rsplit(':').next().unwrap();
    let text = format!(
        "state_dir = \"{state}\"\n[admin]\nsocket = \"{sock}\"\n[metrics]\nlisten = \"\"\n\
         [tiers.hot]\ncapacity = \"1GiB\"\n[tiers.warm]\ncapacity = \"0\"\n\
         [cold]\nkind = \"s3\"\nbucket = \"{bucket}\"\nendpoint = \"http://198.18.0.1:{port}\"\nregion = \"us-east-1\"\n\
         allow_http = true\nchunk_size = \"1MiB\"\n\
         [peers]\nmembers = [{members}]\nlisten = \"{addr}:{PEER_PORT}\"\nadvertise = \"{me}\"\n\
         secret_file = \"{secret}\"\nconnect_timeout = \"200ms\"\nhot_fanout = 1\n",
        state = dir.path().join("state").display(),
        sock = socket.display(),
        bucket = rgw.bucket,
        members = members.join(", "),
        addr = Net::addr(i),
        me = name(i),
        secret = secret.display(),
    );
    std::fs::write(&config, text).unwrap();
    Daemon::with_config_in(dir, config, socket, Some(net.ns(i)))
}

fn sha(b: &[u8]) -> String {
    hex::encode(Sha256::digest(b))
}

/// The ranged GETs RGW served of `key`, from its own log.
fn gets_of(rgw: &Rgw, key: &str, least: usize) -> usize {
    rgw.requests_under(key, least).iter().filter(|r| r.starts_with("GET ")).count()
}

/// Reads `key` on each of `nodes` at once, and checks every byte against `want`.
fn read_everywhere(nodes: &[&Daemon], key: &str, want: &[u8]) {
    std::thread::scope(|s| {
        for n in nodes {
            s.spawn(|| assert_eq!(sha(&n.cat(key)), sha(want), "{key} as read on a node\n{}", n.log()));
        }
    });
}

#[test]
#[ignore = "needs root, network namespaces and Ceph RGW: run by .ci/run"]
fn three_nodes_fetch_each_chunk_from_rgw_once_and_survive_hot_chunks_a_killed_owner_and_a_liar() {
    let rgw = Rgw::from_env();
    let net = Net::new(NODES);
    let host = rgw.endpoint.trim_start_matches("http://").to_owned();
    let port = host.rsplit(':').next().unwrap().to_owned();
    relay(&format!("198.18.0.1:{port}"), host, Back::delay(Duration::from_millis(80)));
    let corrupt = Arc::new(AtomicBool::new(false));
    relay(NODE1_VIA, format!("{}:{PEER_PORT}", Net::addr(1)), Back::CorruptWhen(corrupt.clone()));
    for i in 0..NODES {
        net.wait_reaches(i, &format!("198.18.0.1:{port}"));
    }
    let shared = tempfile::tempdir().unwrap();
    let secret = shared.path().join("peer-secret");
    std::fs::write(&secret, format!("{}\n", sha(b"this cluster's peer secret"))).unwrap();
    let mut nodes: Vec<Daemon> = (0..NODES).map(|i| node(i, &net, &rgw, &secret)).collect();

    let prefix = unique_prefix("peers");
    let store = rgw.store();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let (a, b, c) = (format!("{prefix}shard-a.tar"), format!("{prefix}shard-b.tar"), format!("{prefix}shard-c.tar"));
    let (data_a, data_b, data_c) = (data(1, 8 * CHUNK - 1000), data(2, 24 * CHUNK), data(3, 16 * CHUNK));
    for (key, bytes) in [(&a, &data_a), (&b, &data_b), (&c, &data_c)] {
        rt.block_on(store.put(&object_store::path::Path::from(key.as_str()), bytes.clone().into())).unwrap();
    }

    // Every node reads the whole shard at once: RGW serves each chunk once, not three times.
    read_everywhere(&nodes.iter().collect::<Vec<_>>(), &a, &data_a);
    assert_eq!(gets_of(&rgw, &a, 8), 8, "one GET per chunk for three nodes: {:#?}", rgw.requests_under(&a, 8));
    let status = nodes[0].status();
    let members = status["peers"]["members"].as_array().unwrap();
    assert_eq!(members.len(), NODES, "{status:#}");
    assert_eq!(members.iter().filter(|m| m["state"] == "self").count(), 1, "{status:#}");
    let peers: Vec<serde_json::Value> = nodes.iter().map(|n| n.status()["peers"].clone()).collect();
    let sum = |field: &str| peers.iter().map(|p| p[field].as_u64().unwrap()).sum::<u64>();
    let size = data_a.len() as u64;
    assert_eq!(sum("received_bytes"), 2 * size, "two of three nodes got each chunk from a peer");
    // Each chunk was wanted by two nodes at once, and the owners send one at a time
    // (hot_fanout = 1): the second asker got it from the first.
    assert_eq!(sum("served_bytes") + sum("holder_served_bytes"), 2 * size, "{peers:#?}");
    assert!(sum("redirects") >= 1 && sum("holder_served_bytes") > 0, "no hot chunk was sent on: {peers:#?}");
    assert!(sum("served_bytes") < 2 * size, "the owners sent every copy themselves: {peers:#?}");

    // A request without the cluster's secret is refused, and fetches nothing.
    let url = format!("http://{}:{PEER_PORT}/strata/v1/chunk?k=e30", Net::addr(0));
    let out = Command::new("curl")
        .args(["-s", "-o", "/dev/null", "-w", "%{http_code}", "--http2-prior-knowledge", &url])
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout), "401");

    // The third node dies; the others read the next shard, the right bytes, still one GET a chunk.
    // (Of 24 chunks the dead node owns some but for a chance of (2/3)^24.)
    nodes[2].kill9();
    read_everywhere(&[&nodes[0], &nodes[1]], &b, &data_b);
    assert_eq!(gets_of(&rgw, &b, 24), 24, "one GET per chunk with an owner dead: {:#?}", rgw.requests_under(&b, 24));
    let dead = format!("{}:{PEER_PORT}", Net::addr(2));
    assert_eq!(member_state(&nodes[0], &dead), "suspect");
    for n in [&nodes[0], &nodes[1]] {
        assert_eq!(n.status()["peers"]["corrupt"], 0, "no peer sent a wrong byte");
    }

    // Node 1's answers now reach node 0 with a byte of each DATA frame flipped. Node 0 reads the
    // last shard, of which node 1 is asked for about half (it owns a third, and is the next
    // choice for the dead node's third): every byte right, the liar caught and then skipped, RGW
    // asked again only for the chunks the liar fetched before it was caught. `tier cat` reads
    // READ_AHEAD (4) chunks at once, so up to 4 answers can be in flight to the liar when the
    // first is caught; each of those is caught on its own, none is served.
    corrupt.store(true, Ordering::Relaxed);
    assert_eq!(sha(&nodes[0].cat(&c)), sha(&data_c), "{}", nodes[0].log());
    let p0 = nodes[0].status()["peers"].clone();
    let caught = p0["corrupt"].as_u64().unwrap() as usize;
    assert!((1..=4).contains(&caught), "caught {caught} times with 4 reads in flight: {p0:#}");
    assert_eq!(member_state(&nodes[0], NODE1_VIA), "suspect");
    let gets = gets_of(&rgw, &c, 16);
    assert!(
        (16..=16 + caught).contains(&gets),
        "{gets} GETs for 16 chunks, {caught} caught: {:#?}",
        rgw.requests_under(&c, 16)
    );
    delete_under(&rgw, &prefix);
}

/// `member`'s state as `node` sees it.
fn member_state(node: &Daemon, member: &str) -> String {
    let status = node.status();
    let m = status["peers"]["members"].as_array().unwrap().iter().find(|m| m["name"] == member).cloned();
    m.and_then(|m| m["state"].as_str().map(str::to_owned)).unwrap_or_else(|| panic!("{member}: {status:#}"))
}
