//! The peer tier at cluster scale (`bash benches/cluster.sh`): N `strata daemon`s (N = 1, 4,
//! 8, 16), each in a network namespace of its own on a Linux bridge, against the real Ceph RGW
//! behind one shaped origin link (a relay on the bridge with the origin's rate and round trip).
//! Each node's veth is shaped to the node NIC's rate with HTB. For each workload and each N,
//! on fresh daemons with empty caches:
//! - origin bytes ÷ unique bytes, counted at the origin link itself;
//! - wall time ÷ the time at N = 1;
//! - peer throughput ÷ the veth rate: per node, the bytes it got from peers over the time it
//!   read, against its NIC's rate.
//!
//! Every byte every node reads is checked against the source's sha256. Workloads:
//! (a) every node reads the same dataset; (b) each node reads a disjoint 1/N of it, then the
//! next node's share, as shuffled epochs do; (c) every node starts the same lazy image at once,
//! each with a containerd of its own, against the test registry behind a shaped link of its
//! own (origin bytes: what the daemons fetched from it until every layer was whole on every
//! node; time: until every container printed its line); (d) every node restores the same
//! checkpoint (8 files, read at once); (m) every node pulls the same plain image onto overlayfs
//! through its own registry mirror (`[mirror]`), and runs it; (j) a job start over a dataset
//! of many small objects ([`job_start`]). For (c) and (m), what the registry was asked, from its
//! log ([`registry_counts`]). `STRATA_BENCH_WORKLOADS` ("a b c m d j") picks the workloads.
//! Writes the tables to `target/cluster.md` too.

#[path = "../../tests/common/mod.rs"]
#[allow(unused_imports)]
mod common;
mod cpu;
mod job_start;
mod origin_log;
mod registry_counts;

use common::containerd::{image_blobs, registry};
use common::netns::{Back, Net, relay};
use common::peer_node::{ImageNode, MIRROR_PORT, mirror_hosts};
use common::{BIN, Daemon, Rgw, data, sha, unique_prefix};
use object_store::ObjectStoreExt;
use sha2::{Digest, Sha256};
use std::io::Read;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

const PEER_PORT: u16 = 7470;
const SHARDS: usize = 32;
const CHECKPOINT_FILES: usize = 8;
/// Where the other nodes reach the fault run's lying member: a relay on the bridge that flips
/// a byte of every DATA frame it answers with.
const LIAR_VIA: &str = "198.18.0.1:7471";
/// Where the nodes reach the registry: a relay on the bridge, shaped as the origin link.
const REGISTRY_VIA: &str = "198.18.0.1:5001";
/// The image of workload (c), and what its containers run.
const IMAGE: &str = "strata/python:esgz-opt";
const IMAGE_SCRIPT: &str = "python3 -c 'print(1)'";
/// The plain image of workload (m), which containerd pulls whole.
const PLAIN_IMAGE: (&str, &str) = ("strata/python", "1");

fn env_or<T: std::str::FromStr>(k: &str, default: T) -> T {
    std::env::var(k).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

struct Setup {
    rgw: Rgw,
    origin_port: String,
    origin_sent: Arc<AtomicU64>,
    /// What the registry's link carried.
    registry_sent: Arc<AtomicU64>,
    veth_bits: f64,
    secret: std::path::PathBuf,
}

/// One file of a workload: its key, and the sha256 and size of its bytes.
#[derive(Clone)]
struct File {
    key: String,
    sha: String,
    size: u64,
}

fn node(i: usize, n: usize, net: &Net, s: &Setup) -> Daemon {
    node_with(i, n, net, s, None, "")
}

/// Node `i` of `n`, with `extra` at the end of its config; the others reach node `liar`, if
/// one is named, through [`LIAR_VIA`].
fn node_with(i: usize, n: usize, net: &Net, s: &Setup, liar: Option<usize>, extra: &str) -> Daemon {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("admin.sock");
    let config = dir.path().join("config.toml");
    let name = |j: usize| if liar == Some(j) { LIAR_VIA.to_owned() } else { format!("{}:{PEER_PORT}", Net::addr(j)) };
    let members: Vec<String> = (0..n).map(|j| format!("\"{}\"", name(j))).collect();
    let text = format!(
        "state_dir = \"{state}\"\n[admin]\nsocket = \"{sock}\"\n[metrics]\nlisten = \"\"\n\
         [tiers.hot]\ncapacity = \"8GiB\"\n[tiers.warm]\ncapacity = \"0\"\n\
         [cold]\nkind = \"s3\"\nbucket = \"{bucket}\"\nendpoint = \"http://198.18.0.1:{port}\"\nregion = \"us-east-1\"\n\
         allow_http = true\nchunk_size = \"4MiB\"\n\
         [peers]\nmembers = [{members}]\nlisten = \"{addr}:{PEER_PORT}\"\nadvertise = \"{me}\"\n\
         secret_file = \"{secret}\"\n{extra}",
        state = dir.path().join("state").display(),
        sock = socket.display(),
        bucket = s.rgw.bucket,
        port = s.origin_port,
        members = members.join(", "),
        addr = Net::addr(i),
        me = name(i),
        secret = s.secret.display(),
    );
    std::fs::write(&config, text).unwrap();
    Daemon::with_config_in(dir, config, socket, Some(net.ns(i)))
}

/// Reads `f` through `node`'s cache, hashing as it streams; panics on a wrong byte. Returns
/// the longest wait for the next bytes.
fn read_checked(node: &Daemon, socket: &std::path::Path, f: &File) -> Duration {
    let mut child = Command::new(BIN)
        .arg("tier")
        .arg("--socket")
        .arg(socket)
        .args(["cat", &f.key])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = child.stdout.take().unwrap();
    let (mut h, mut buf, mut len) = (Sha256::new(), vec![0u8; 1 << 20], 0u64);
    let (mut last, mut longest) = (Instant::now(), Duration::ZERO);
    loop {
        let k = out.read(&mut buf).unwrap();
        longest = longest.max(last.elapsed());
        last = Instant::now();
        if k == 0 {
            break;
        }
        h.update(&buf[..k]);
        len += k as u64;
    }
    let status = child.wait().unwrap();
    assert!(status.success() && len == f.size, "cat {} failed or was short ({len} bytes)\n{}", f.key, node.log());
    assert_eq!(hex::encode(h.finalize()), f.sha, "{}: wrong bytes served\n{}", f.key, node.log());
    longest
}

struct Row {
    workload: &'static str,
    n: usize,
    unique: u64,
    origin: u64,
    secs: f64,
    peer_ratio: Option<f64>,
    /// The share of the machine's cores that were busy.
    busy: f64,
}

/// Runs one workload on `n` fresh nodes: `plan(i, n)` is what node `i` reads, in order.
fn run(
    s: &Setup,
    net: &Net,
    workload: &'static str,
    n: usize,
    files: &[File],
    plan: impl Fn(usize, usize) -> Vec<usize>,
) -> Row {
    let nodes: Vec<Daemon> = (0..n).map(|i| node(i, n, net, s)).collect();
    let before = s.origin_sent.load(Ordering::Relaxed);
    let (start, cores) = (Instant::now(), cpu::Cores::now());
    let took: Vec<f64> = std::thread::scope(|sc| {
        let handles: Vec<_> = (0..n)
            .map(|i| {
                let (node, order) = (&nodes[i], plan(i, n));
                let socket = &node.socket;
                sc.spawn(move || {
                    let t = Instant::now();
                    if workload == "d" {
                        // A restore reads every rank's file at once.
                        std::thread::scope(|inner| {
                            for &k in &order {
                                inner.spawn(move || read_checked(node, socket, &files[k]));
                            }
                        });
                    } else {
                        for k in order {
                            read_checked(node, socket, &files[k]);
                        }
                    }
                    t.elapsed().as_secs_f64()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let (secs, busy) = (start.elapsed().as_secs_f64(), cores.busy_since());
    let origin = s.origin_sent.load(Ordering::Relaxed) - before;
    let unique: u64 = {
        let mut read: Vec<usize> = (0..n).flat_map(|i| plan(i, n)).collect();
        read.sort_unstable();
        read.dedup();
        read.iter().map(|&k| files[k].size).sum()
    };
    let peer_ratio = (n > 1).then(|| {
        let per_node: Vec<f64> = nodes
            .iter()
            .zip(&took)
            .map(|(d, t)| d.status()["peers"]["received_bytes"].as_u64().unwrap() as f64 * 8.0 / t / s.veth_bits)
            .collect();
        per_node.iter().sum::<f64>() / per_node.len() as f64
    });
    save_logs(&format!("{workload}-n{n}"), &nodes);
    eprintln!("cluster: ({workload}) N={n}: {secs:.1} s, origin {origin} B of {unique} unique");
    Row { workload, n, unique, origin, secs, peer_ratio, busy }
}

/// Node `i` of `n` for (c) and (m), with a registry mirror.
fn mirror_node(i: usize, n: usize, net: &Net, s: &Setup) -> ImageNode {
    let routes = [(registry(), REGISTRY_VIA.to_owned())];
    let mirror = format!("[mirror]\nlisten = \"{}:{MIRROR_PORT}\"\n", Net::addr(i));
    ImageNode::start_with(i, n, net, &s.secret, &routes, &mirror)
}

/// Workload (c) on `n` fresh nodes, each with a containerd of its own and its node's mirror:
/// every node pulls and starts [`IMAGE`] at once, and then fetches its layers whole in the
/// background.
fn images(s: &Setup, net: &Net, n: usize) -> (Row, registry_counts::Counts) {
    let image = format!("{}/{IMAGE}", registry());
    let nodes: Vec<ImageNode> = (0..n).map(|i| mirror_node(i, n, net, s)).collect();
    let hosts = tempfile::tempdir().unwrap();
    let mark = origin_log::Mark::now("STRATA_TEST_REGISTRY_LOG");
    let before = s.registry_sent.load(Ordering::Relaxed);
    let (start, cores) = (Instant::now(), cpu::Cores::now());
    std::thread::scope(|sc| {
        for (i, node) in nodes.iter().enumerate() {
            let (image, hosts) = (&image, mirror_hosts(hosts.path(), i, &registry()));
            sc.spawn(move || {
                let out = node.start_container_via(image, &format!("start-{i}"), IMAGE_SCRIPT, Some(&hosts));
                assert_eq!(out, "1\n", "node {i}'s container\n{}", node.daemon.log());
            });
        }
    });
    let (secs, busy) = (start.elapsed().as_secs_f64(), cores.busy_since());
    let reports: Vec<(Vec<serde_json::Value>, f64)> = nodes
        .iter()
        .map(|node| {
            let report = node.layers_done(Duration::from_secs(600));
            (report, start.elapsed().as_secs_f64())
        })
        .collect();
    let origin = s.registry_sent.load(Ordering::Relaxed) - before;
    let unique: u64 = reports[0].0.iter().map(|l| l["blob_size"].as_u64().unwrap()).sum();
    for (i, (report, _)) in reports.iter().enumerate() {
        assert!(
            report.iter().all(|l| l["lazy"] == true && l["chunks_cached"] == l["chunks_total"]),
            "node {i}: {report:#?}"
        );
        let peers = nodes[i].daemon.status()["peers"].clone();
        assert_eq!(peers["corrupt"], 0, "node {i}: {peers:#}");
    }
    let peer_ratio = (n > 1).then(|| {
        let per_node: Vec<f64> = nodes
            .iter()
            .zip(&reports)
            .map(|(node, (_, t))| {
                let got = node.daemon.status()["peers"]["received_bytes"].as_u64().unwrap() as f64;
                got * 8.0 / t / s.veth_bits
            })
            .collect();
        per_node.iter().sum::<f64>() / per_node.len() as f64
    });
    eprintln!("cluster: (c) N={n}: {secs:.1} s to every start, origin {origin} B of {unique} unique");
    let layers: Vec<(String, u64)> = reports[0]
        .0
        .iter()
        .map(|l| (l["layer"].as_str().unwrap().to_owned(), l["blob_size"].as_u64().unwrap()))
        .collect();
    let counts = registry_counts::count("c", n, &mark, IMAGE.split(':').next().unwrap(), &layers);
    (Row { workload: "c", n, unique, origin, secs, peer_ratio, busy }, counts)
}

/// Workload (m) on `n` fresh nodes: every node's containerd pulls [`PLAIN_IMAGE`] onto
/// overlayfs with its node's mirror in its hosts.toml, and runs it.
fn mirrored(s: &Setup, net: &Net, n: usize) -> (Row, registry_counts::Counts) {
    let (repo, tag) = PLAIN_IMAGE;
    let image = format!("{}/{repo}:{tag}", registry());
    let nodes: Vec<ImageNode> = (0..n).map(|i| mirror_node(i, n, net, s)).collect();
    let hosts = tempfile::tempdir().unwrap();
    // Read before the mark: this bench's own requests for the tag are not counted.
    let blobs = image_blobs(repo, tag);
    let mark = origin_log::Mark::now("STRATA_TEST_REGISTRY_LOG");
    let before = s.registry_sent.load(Ordering::Relaxed);
    let (start, cores) = (Instant::now(), cpu::Cores::now());
    std::thread::scope(|sc| {
        for (i, node) in nodes.iter().enumerate() {
            let d = mirror_hosts(hosts.path(), i, &registry());
            let image = &image;
            sc.spawn(move || {
                let dir = d.display().to_string();
                let out = node.containerd.ctr(&["images", "pull", "--hosts-dir", &dir, image]);
                assert!(out.status.success(), "pull on node {i}: {}", String::from_utf8_lossy(&out.stderr));
                let said = node.containerd.run_captured(
                    "overlayfs",
                    image,
                    &format!("m-{i}"),
                    IMAGE_SCRIPT,
                    &node.daemon.log(),
                );
                assert_eq!(said, "1\n", "node {i}'s container");
            });
        }
    });
    let (secs, busy) = (start.elapsed().as_secs_f64(), cores.busy_since());
    let origin = s.registry_sent.load(Ordering::Relaxed) - before;
    let counts = registry_counts::count("m", n, &mark, repo, &blobs[1..]);
    let unique: u64 = blobs.iter().map(|(_, size)| size).sum();
    let peer_ratio = (n > 1).then(|| {
        let per_node: Vec<f64> = nodes
            .iter()
            .enumerate()
            .map(|(i, node)| node.counter(i, "strata_peer_received_bytes") as f64 * 8.0 / secs / s.veth_bits)
            .collect();
        per_node.iter().sum::<f64>() / per_node.len() as f64
    });
    eprintln!("cluster: (m) N={n}: {secs:.1} s to every pull and run, origin {origin} B of {unique} unique");
    (Row { workload: "m", n, unique, origin, secs, peer_ratio, busy }, counts)
}

fn put_files(s: &Setup, prefix: &str, name: &str, count: usize, size: usize, seed: u64) -> Vec<File> {
    let store = s.rgw.store();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    (0..count)
        .map(|k| {
            let bytes = data(seed + k as u64, size);
            let key = format!("{prefix}{name}/part-{k:03}");
            let sha = sha(&bytes);
            rt.block_on(store.put(&object_store::path::Path::from(key.as_str()), bytes.into())).unwrap();
            File { key, sha, size: size as u64 }
        })
        .collect()
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return; // `cargo test --benches` lists benches; this one needs root and RGW.
    }
    let rgw = Rgw::from_env();
    let mib: usize = env_or("STRATA_BENCH_MIB", 2048);
    let counts: Vec<usize> = std::env::var("STRATA_BENCH_NODES")
        .unwrap_or_else(|_| "1 4 8 16".into())
        .split_whitespace()
        .map(|v| v.parse().expect("STRATA_BENCH_NODES: numbers of nodes"))
        .collect();
    let origin_mbit: f64 = env_or("STRATA_BENCH_ORIGIN_MBIT", 1000.0);
    let rtt_ms: u64 = env_or("STRATA_BENCH_RTT_MS", 10);
    let veth_mbit: f64 = env_or("STRATA_BENCH_VETH_MBIT", 2000.0);
    let shared = tempfile::tempdir().unwrap();
    let secret = shared.path().join("peer-secret");
    std::fs::write(&secret, format!("{}\n", sha(b"the bench cluster's peer secret"))).unwrap();
    let host = rgw.endpoint.trim_start_matches("http://").to_owned();
    let origin_port = host.rsplit(':').next().unwrap().to_owned();
    let origin_sent = Arc::new(AtomicU64::new(0));
    // One bridge and the most namespaces any N needs, for the whole run: the relay is bound to
    // the bridge's address. Each N runs fresh daemons in the first N of them.
    let most = counts.iter().copied().max().unwrap_or(1);
    let net = Net::new(most);
    relay(
        &format!("198.18.0.1:{origin_port}"),
        host,
        Back::Link {
            delay: Duration::from_millis(rtt_ms),
            bytes_per_sec: Some(origin_mbit * 1e6 / 8.0),
            sent: origin_sent.clone(),
        },
    );
    let registry_sent = Arc::new(AtomicU64::new(0));
    relay(
        REGISTRY_VIA,
        registry(),
        Back::Link {
            delay: Duration::from_millis(rtt_ms),
            bytes_per_sec: Some(origin_mbit * 1e6 / 8.0),
            sent: registry_sent.clone(),
        },
    );
    for i in 0..most {
        net.shape(i, veth_mbit);
        net.wait_reaches(i, &format!("198.18.0.1:{origin_port}"));
        net.wait_reaches(i, REGISTRY_VIA);
    }
    let s = Setup { rgw, origin_port, origin_sent, registry_sent, veth_bits: veth_mbit * 1e6, secret };
    let prefix = unique_prefix("cluster");
    let shard = (mib << 20) / SHARDS;
    let workloads = std::env::var("STRATA_BENCH_WORKLOADS").unwrap_or_else(|_| "a b c m d j".into());
    let on = |w: &str| workloads.split_whitespace().any(|x| x == w);
    let put = |name, count, size, seed| if on(name) { put_files(&s, &prefix, name, count, size, seed) } else { vec![] };
    let a = put("a", SHARDS, shard, 1000);
    let b = put("b", SHARDS, shard, 2000);
    let d = put("d", CHECKPOINT_FILES, (mib << 20) / CHECKPOINT_FILES, 3000);
    let (objects, named): (usize, usize) =
        (env_or("STRATA_BENCH_OBJECTS", 100_000), env_or("STRATA_BENCH_NAMED", 2000));
    let job = on("j").then(|| job_start::put(&s, &prefix, objects, named));
    let (mut rows, mut asked, mut jobs) = (Vec::new(), Vec::new(), Vec::new());
    for &n in &counts {
        if on("a") {
            rows.push(run(&s, &net, "a", n, &a, |_, _| (0..SHARDS).collect()));
        }
        if on("b") {
            // Node i's share, then node i+1's: every shard is read twice, by two nodes, one epoch apart.
            rows.push(run(&s, &net, "b", n, &b, |i, n| {
                let share = |j: usize| (0..SHARDS).filter(move |k| k % n == j % n);
                share(i).chain(if n > 1 { Some(share(i + 1)) } else { None }.into_iter().flatten()).collect()
            }));
        }
        for (w, f) in [("c", images as fn(&Setup, &Net, usize) -> _), ("m", mirrored)] {
            if on(w) {
                let (row, counts) = f(&s, &net, n);
                rows.push(row);
                asked.push(counts);
            }
        }
        if on("d") {
            rows.push(run(&s, &net, "d", n, &d, |_, _| (0..CHECKPOINT_FILES).collect()));
        }
        if let Some(job) = &job {
            jobs.push(job_start::run(&s, &net, n, job));
        }
    }
    let faults = if on("a") {
        let most = counts.iter().copied().max().unwrap_or(1);
        faults(&s, &net, most, &put_files(&s, &prefix, "dataset-f", SHARDS, shard, 4000))
    } else {
        String::new()
    };
    drop(net);
    let mut table = render(&rows, mib, origin_mbit, rtt_ms, veth_mbit);
    table += &faults;
    if !asked.is_empty() {
        table += &registry_counts::render(&asked);
    }
    if !jobs.is_empty() {
        table += &job_start::render(&jobs, objects, named);
    }
    println!("{table}");
    let _ = std::fs::write("target/cluster.md", &table);
    common::s3::delete_under(&s.rgw, &prefix);
}

fn render(rows: &[Row], mib: usize, origin_mbit: f64, rtt_ms: u64, veth_mbit: f64) -> String {
    let mut t = format!(
        "{mib} MiB per workload (a), (b) and (d); (c) is {IMAGE}, its containers running `{IMAGE_SCRIPT}`; \
         origin links (RGW, the registry) {origin_mbit} Mbit/s with {rtt_ms} ms added; node veths {veth_mbit} Mbit/s\n\n\
         | workload | N | origin ÷ unique | time ÷ time at N=1 | peer throughput ÷ veth | cores busy | wall (s) |\n|---|---|---|---|---|---|---|\n"
    );
    for r in rows {
        let base = rows.iter().find(|b| b.workload == r.workload && b.n == 1).map(|b| b.secs);
        let rel = base.map_or("–".into(), |b| format!("{:.2}", r.secs / b));
        let peer = r.peer_ratio.map_or("–".into(), |p| format!("{p:.2}"));
        t += &format!(
            "| ({}) | {} | {:.3} | {rel} | {peer} | {:.0}% | {:.1} |\n",
            r.workload,
            r.n,
            r.origin as f64 / r.unique as f64,
            r.busy * 100.0,
            r.secs
        );
    }
    t
}

/// Workload (a) on `n` ≥ 5 nodes, with three of them hit a second in: one SIGKILLed, one
/// SIGSTOPped and one with its link set down; and one of the readers sends every answer with
/// bytes changed on the wire. The other nodes read every file, every byte checked; the origin
/// bytes ÷ unique bytes, the longest wait for bytes and the lies caught are reported.
fn faults(s: &Setup, net: &Net, n: usize, files: &[File]) -> String {
    if n < 5 {
        return String::new();
    }
    let readers = n - 3;
    let liar = readers - 1;
    relay(LIAR_VIA, format!("{}:{PEER_PORT}", Net::addr(liar)), Back::CorruptWhen(Arc::new(true.into())));
    let mut nodes: Vec<Daemon> = (0..n).map(|i| node_with(i, n, net, s, Some(liar), "")).collect();
    let before = s.origin_sent.load(Ordering::Relaxed);
    let start = Instant::now();
    let (stopped, unlinked) = (nodes[n - 2].pid().unwrap(), net.host_veth(n - 1));
    let (reading, hit) = nodes.split_at_mut(readers);
    let waits: Vec<Duration> = std::thread::scope(|sc| {
        let handles: Vec<_> = reading
            .iter()
            .map(|node| {
                sc.spawn(move || files.iter().map(|f| read_checked(node, &node.socket, f)).max().unwrap_or_default())
            })
            .collect();
        std::thread::sleep(Duration::from_secs(1));
        hit[0].kill9();
        Command::new("kill").args(["-STOP", &stopped.to_string()]).status().unwrap();
        common::netns::ip(&["link", "set", &unlinked, "down"]);
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let secs = start.elapsed().as_secs_f64();
    Command::new("kill").args(["-CONT", &stopped.to_string()]).status().unwrap();
    common::netns::ip(&["link", "set", &unlinked, "up"]);
    let origin = s.origin_sent.load(Ordering::Relaxed) - before;
    let unique: u64 = files.iter().map(|f| f.size).sum();
    let peers: Vec<serde_json::Value> = nodes[..readers].iter().map(|d| d.status()["peers"].clone()).collect();
    let sum = |field: &str| peers.iter().map(|p| p[field].as_u64().unwrap_or(0)).sum::<u64>();
    let (fallbacks, caught) = (sum("origin_fallbacks"), sum("corrupt"));
    assert!(caught > 0, "no node caught the lying member's bytes: {peers:#?}");
    let longest = waits.iter().max().copied().unwrap_or_default();
    save_logs("faults", &nodes);
    eprintln!("cluster: faults N={n}: {secs:.1} s, origin {origin} B of {unique}, longest wait {longest:?}");
    format!(
        "\nFaults, workload (a) on {n} nodes, {readers} reading: a second in, one owner SIGKILLed, one \
         SIGSTOPped, one with its link down, and one reader's answers corrupted on the wire ({caught} \
         caught). Every byte right; origin ÷ unique {:.3} (goal ≤ 1.5); longest wait for bytes {:.2} s; \
         {fallbacks} origin fallbacks; {secs:.1} s.\n",
        origin as f64 / unique as f64,
        longest.as_secs_f64()
    )
}

/// The daemons' logs under `target/cluster-logs/`, for what a run's figures do not say.
fn save_logs(run: &str, nodes: &[Daemon]) {
    let logs = std::path::Path::new("target/cluster-logs");
    let _ = std::fs::create_dir_all(logs);
    for (i, d) in nodes.iter().enumerate() {
        let _ = std::fs::write(logs.join(format!("{run}-node-{i}.log")), d.log());
    }
}
