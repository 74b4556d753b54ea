//! The peer tier across three `strata daemon`s, each in a network namespace of its own on a
//! Linux bridge, against the real Ceph RGW that `.ci/run` starts (reached through a relay on
//! the bridge that adds a round trip's delay, since RGW listens on loopback). What a platform
//! team counts on: each chunk crosses from RGW once however many nodes read it, as RGW's own
//! log shows; a chunk all nodes want at once is sent on by its first receivers rather than all
//! by its owner; a killed owner is survived with the right bytes and still one fetch per chunk;
//! a member whose bytes are changed on the wire is caught and skipped; and the peer port
//! refuses a request without the cluster's secret.

mod common;

use common::s3::delete_under;
use common::*;
use object_store::ObjectStoreExt;
use sha2::{Digest, Sha256};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

const NODES: usize = 3;
const CHUNK: usize = 1 << 20;
const PEER_PORT: u16 = 7470;
/// Where the other nodes reach node 1: a relay on the bridge that can change its bytes.
const NODE1_VIA: &str = "198.18.0.1:7471";

fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().expect("ip runs");
    assert!(out.status.success(), "ip {args:?}: {}", String::from_utf8_lossy(&out.stderr));
}

/// A bridge at 198.18.0.1 and a namespace per node at 198.18.0.11 and up, removed when dropped.
struct Net {
    tag: String,
}

impl Net {
    fn bridge(&self) -> String {
        format!("{}b", self.tag)
    }

    fn ns(&self, i: usize) -> String {
        format!("{}n{i}", self.tag)
    }

    fn addr(i: usize) -> String {
        format!("198.18.0.{}", 11 + i)
    }

    fn new() -> Net {
        // Short and unique: interface names are at most 15 bytes.
        let net = Net { tag: format!("sp{}", std::process::id() % 100_000) };
        let br = net.bridge();
        let _ = Command::new("ip").args(["link", "del", &br]).output();
        ip(&["link", "add", &br, "type", "bridge"]);
        ip(&["addr", "add", "198.18.0.1/24", "dev", &br]);
        ip(&["link", "set", &br, "up"]);
        for i in 0..NODES {
            let (ns, host, inner) = (net.ns(i), format!("{}h{i}", net.tag), format!("{}i{i}", net.tag));
            let _ = Command::new("ip").args(["netns", "del", &ns]).output();
            ip(&["netns", "add", &ns]);
            ip(&["link", "add", &host, "type", "veth", "peer", "name", &inner]);
            ip(&["link", "set", &inner, "netns", &ns]);
            ip(&["link", "set", &host, "master", &br, "up"]);
            ip(&["-n", &ns, "addr", "add", &format!("{}/24", Net::addr(i)), "dev", &inner]);
            ip(&["-n", &ns, "link", "set", &inner, "up"]);
            ip(&["-n", &ns, "link", "set", "lo", "up"]);
        }
        net
    }

    /// Waits until namespace `i` reaches `addr` (a fresh veth can take a moment to forward).
    fn wait_reaches(&self, i: usize, addr: &str) {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let ok = Command::new("nsenter")
                .arg(format!("--net=/var/run/netns/{}", self.ns(i)))
                .args(["curl", "-s", "-o", "/dev/null", "--max-time", "1", &format!("http://{addr}/")])
                .status()
                .is_ok_and(|s| s.success());
            if ok {
                return;
            }
            assert!(Instant::now() < deadline, "namespace {} never reached {addr}", self.ns(i));
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        for i in 0..NODES {
            let _ = Command::new("ip").args(["netns", "del", &self.ns(i)]).output();
        }
        let _ = Command::new("ip").args(["link", "del", &self.bridge()]).output();
    }
}

/// What a relay does to the bytes coming back from upstream.
#[derive(Clone)]
enum Back {
    /// Holds each answer that follows a quiet spell for `0` before forwarding it: a round trip
    /// to a distant store, so that nodes asking for one chunk overlap as they do on real links.
    Delay(Duration),
    /// Reads HTTP/2 frames and, while the flag is set, flips the first byte of each DATA frame's
    /// payload: a member whose disk or NIC changes bytes, which only the requester's check sees.
    CorruptWhen(Arc<AtomicBool>),
}

/// Forwards every connection to `listen` on to `upstream`, on a thread of its own.
fn relay(listen: &str, upstream: String, back: Back) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = std::net::TcpListener::bind(listen).unwrap_or_else(|e| panic!("relay on {listen}: {e}"));
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        rt.block_on(async move {
            listener.set_nonblocking(true).unwrap();
            let listener = tokio::net::TcpListener::from_std(listener).unwrap();
            loop {
                let (inbound, _) = listener.accept().await.unwrap();
                let (upstream, back) = (upstream.clone(), back.clone());
                tokio::spawn(async move {
                    let Ok(out) = tokio::net::TcpStream::connect(&upstream).await else { return };
                    let (mut in_r, mut in_w) = inbound.into_split();
                    let (mut out_r, mut out_w) = out.into_split();
                    tokio::spawn(async move { tokio::io::copy(&mut in_r, &mut out_w).await });
                    let mut buf = vec![0u8; 64 << 10];
                    match back {
                        Back::Delay(delay) => {
                            let mut last = Instant::now();
                            while let Ok(n @ 1..) = out_r.read(&mut buf).await {
                                if last.elapsed() > Duration::from_millis(20) {
                                    tokio::time::sleep(delay).await;
                                }
                                if in_w.write_all(&buf[..n]).await.is_err() {
                                    break;
                                }
                                last = Instant::now();
                            }
                        }
                        Back::CorruptWhen(flag) => loop {
                            let mut head = [0u8; 9];
                            if out_r.read_exact(&mut head).await.is_err() {
                                break;
                            }
                            let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
                            let mut payload = vec![0u8; len];
                            if out_r.read_exact(&mut payload).await.is_err() {
                                break;
                            }
                            // DATA is type 0; with PADDED (0x8) the first byte is the pad length.
                            let first = usize::from(head[4] & 0x8 != 0);
                            if head[3] == 0 && len > first && flag.load(Ordering::Relaxed) {
                                payload[first] ^= 0x01;
                            }
                            if in_w.write_all(&head).await.is_err() || in_w.write_all(&payload).await.is_err() {
                                break;
                            }
                        },
                    }
                });
            }
        });
    });
}

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
    let net = Net::new();
    let host = rgw.endpoint.trim_start_matches("http://").to_owned();
    let port = host.rsplit(':').next().unwrap().to_owned();
    relay(&format!("198.18.0.1:{port}"), host, Back::Delay(Duration::from_millis(80)));
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
    // choice for the dead node's third): every byte right, the liar caught once and skipped, RGW asked again only for
    // the one chunk the liar fetched before it was caught.
    corrupt.store(true, Ordering::Relaxed);
    assert_eq!(sha(&nodes[0].cat(&c)), sha(&data_c), "{}", nodes[0].log());
    let p0 = nodes[0].status()["peers"].clone();
    assert_eq!(p0["corrupt"], 1, "{p0:#}");
    assert_eq!(member_state(&nodes[0], NODE1_VIA), "suspect");
    let gets = gets_of(&rgw, &c, 16);
    assert!((16..=17).contains(&gets), "{gets} GETs for 16 chunks: {:#?}", rgw.requests_under(&c, 16));
    delete_under(&rgw, &prefix);
}

/// `member`'s state as `node` sees it.
fn member_state(node: &Daemon, member: &str) -> String {
    let status = node.status();
    let m = status["peers"]["members"].as_array().unwrap().iter().find(|m| m["name"] == member).cloned();
    m.and_then(|m| m["state"].as_str().map(str::to_owned)).unwrap_or_else(|| panic!("{member}: {status:#}"))
}
