//! The peer tier across three `strata daemon`s, each in a network namespace of its own on a
//! Linux bridge, against the real Ceph RGW that `.ci/run` starts (reached through a relay on
//! the bridge, since RGW listens on loopback). What a platform team counts on: each chunk
//! crosses from RGW once however many nodes read it, as RGW's own log shows; a killed owner is
//! survived with the right bytes and still one fetch per chunk; and the peer port refuses a
//! request without the cluster's secret.

mod common;

use common::s3::delete_under;
use common::*;
use object_store::ObjectStoreExt;
use sha2::{Digest, Sha256};
use std::process::Command;
use std::time::{Duration, Instant};

const NODES: usize = 3;
const CHUNK: usize = 1 << 20;
const PEER_PORT: u16 = 7470;

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

/// Forwards every connection to `listen` on to `upstream`, on a thread of its own.
fn relay(listen: &str, upstream: String) {
    let listener = std::net::TcpListener::bind(listen).unwrap_or_else(|e| panic!("relay on {listen}: {e}"));
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        rt.block_on(async move {
            listener.set_nonblocking(true).unwrap();
            let listener = tokio::net::TcpListener::from_std(listener).unwrap();
            loop {
                let (mut inbound, _) = listener.accept().await.unwrap();
                let upstream = upstream.clone();
                tokio::spawn(async move {
                    if let Ok(mut out) = tokio::net::TcpStream::connect(&upstream).await {
                        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut out).await;
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
    let members: Vec<String> = (0..NODES).map(|j| format!("\"{}:{PEER_PORT}\"", Net::addr(j))).collect();
    let port = rgw.endpoint.rsplit(':').next().unwrap();
    let text = format!(
        "state_dir = \"{state}\"\n[admin]\nsocket = \"{sock}\"\n[metrics]\nlisten = \"\"\n\
         [tiers.hot]\ncapacity = \"1GiB\"\n[tiers.warm]\ncapacity = \"0\"\n\
         [cold]\nkind = \"s3\"\nbucket = \"{bucket}\"\nendpoint = \"http://198.18.0.1:{port}\"\nregion = \"us-east-1\"\n\
         allow_http = true\nchunk_size = \"1MiB\"\n\
         [peers]\nmembers = [{members}]\nlisten = \"{addr}:{PEER_PORT}\"\nsecret_file = \"{secret}\"\n\
         connect_timeout = \"200ms\"\n",
        state = dir.path().join("state").display(),
        sock = socket.display(),
        bucket = rgw.bucket,
        members = members.join(", "),
        addr = Net::addr(i),
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
fn three_nodes_fetch_each_chunk_from_rgw_once_and_survive_a_killed_owner() {
    let rgw = Rgw::from_env();
    let net = Net::new();
    let host = rgw.endpoint.trim_start_matches("http://").to_owned();
    let port = host.rsplit(':').next().unwrap().to_owned();
    relay(&format!("198.18.0.1:{port}"), host);
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
    let (a, b) = (format!("{prefix}shard-a.tar"), format!("{prefix}shard-b.tar"));
    let (data_a, data_b) = (data(1, 8 * CHUNK - 1000), data(2, 8 * CHUNK));
    for (key, bytes) in [(&a, &data_a), (&b, &data_b)] {
        rt.block_on(store.put(&object_store::path::Path::from(key.as_str()), bytes.clone().into())).unwrap();
    }

    // Every node reads the whole shard at once: RGW serves each chunk once, not three times.
    read_everywhere(&nodes.iter().collect::<Vec<_>>(), &a, &data_a);
    assert_eq!(gets_of(&rgw, &a, 8), 8, "one GET per chunk for three nodes: {:#?}", rgw.requests_under(&a, 8));
    let status = nodes[0].status();
    let members = status["peers"]["members"].as_array().unwrap();
    assert_eq!(members.len(), NODES, "{status:#}");
    assert_eq!(members.iter().filter(|m| m["state"] == "self").count(), 1, "{status:#}");
    let received: u64 = nodes.iter().map(|n| n.status()["peers"]["received_bytes"].as_u64().unwrap()).sum();
    assert_eq!(received, 2 * data_a.len() as u64, "two of three nodes got each chunk from a peer");

    // A request without the cluster's secret is refused, and fetches nothing.
    let url = format!("http://{}:{PEER_PORT}/strata/v1/chunk?k=e30", Net::addr(0));
    let out = Command::new("curl")
        .args(["-s", "-o", "/dev/null", "-w", "%{http_code}", "--http2-prior-knowledge", &url])
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout), "401");

    // The second node dies; the others read the next shard, the right bytes, still one GET a chunk.
    nodes[1].kill9();
    read_everywhere(&[&nodes[0], &nodes[2]], &b, &data_b);
    assert_eq!(gets_of(&rgw, &b, 8), 8, "one GET per chunk with an owner dead: {:#?}", rgw.requests_under(&b, 8));
    let after = nodes[0].status();
    let dead = format!("{}:{PEER_PORT}", Net::addr(1));
    let state = after["peers"]["members"].as_array().unwrap().iter().find(|m| m["name"] == dead.as_str()).unwrap();
    assert_eq!(state["state"], "suspect", "{after:#}");
    for n in [&nodes[0], &nodes[2]] {
        assert_eq!(n.status()["peers"]["corrupt"], 0, "no peer sent a wrong byte");
    }
    delete_under(&rgw, &prefix);
}
