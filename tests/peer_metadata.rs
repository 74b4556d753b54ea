//! Metadata through the peer tier: three `strata daemon`s in network namespaces of their own on
//! a Linux bridge, each mounting the same prefixes of the real Ceph RGW that `.ci/run` starts
//! (through a relay on the bridge). What a job start on many nodes counts on: every node sees
//! the whole tree, and RGW lists each directory once for the cluster, HEADs each key looked up
//! by name once, and lists a snapshotted prefix once, as its own log shows; a listing is never
//! trusted past the mount's TTL, so a new object shows on every node once it is over; and a
//! dead directory owner is survived with correct listings.

mod common;

use common::netns::{Back, Net, relay};
use common::s3::delete_under;
use common::*;
use object_store::ObjectStoreExt;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;
use strata_tiering::peer::meta::{MetaKind, MetaRequest};
use strata_tiering::peer::{Member, rank};

const NODES: usize = 3;
const PEER_PORT: u16 = 7470;
const TTL: Duration = Duration::from_secs(3);
const DIRS: [&str; 3] = ["a", "b", "c"];

struct MountNode {
    daemon: Daemon,
    mnt: PathBuf,
    mnt_dir: tempfile::TempDir,
}

impl MountNode {
    /// Where mount `name` of [`node_with`] is.
    fn at(&self, name: &str) -> PathBuf {
        self.mnt_dir.path().join(name)
    }
}

/// A node with one mount of `prefix`, at `mnt`.
fn node(i: usize, net: &Net, rgw: &Rgw, secret: &Path, prefix: &str, rgw_via: &str) -> MountNode {
    let extra = format!("metadata_ttl = \"{}s\"\n", TTL.as_secs());
    node_with(i, net, rgw, secret, rgw_via, &[("data", prefix, &extra)])
}

/// A node with read-only mounts `(name, prefix, extra settings)`, each at [`MountNode::at`].
fn node_with(i: usize, net: &Net, rgw: &Rgw, secret: &Path, rgw_via: &str, mounts: &[(&str, &str, &str)]) -> MountNode {
    let dir = tempfile::tempdir().unwrap();
    let mnt_dir = tempfile::tempdir().unwrap();
    let mnt = mnt_dir.path().join(mounts[0].0);
    let sections: String = mounts
        .iter()
        .map(|(name, prefix, extra)| {
            format!(
                "[[mounts]]\npath = \"{}\"\nprefix = \"{}\"\nread_only = true\n{extra}",
                mnt_dir.path().join(name).display(),
                prefix.trim_end_matches('/')
            )
        })
        .collect();
    let socket = dir.path().join("admin.sock");
    let config = dir.path().join("config.toml");
    let members: Vec<String> = (0..NODES).map(|j| format!("\"{}:{PEER_PORT}\"", Net::addr(j))).collect();
    let text = format!(
        "state_dir = \"{state}\"\n[admin]\nsocket = \"{sock}\"\n[metrics]\nlisten = \"\"\n\
         [tiers.hot]\ncapacity = \"1GiB\"\n[tiers.warm]\ncapacity = \"0\"\n\
         [cold]\nkind = \"s3\"\nbucket = \"{bucket}\"\nendpoint = \"http://{rgw_via}\"\nregion = \"us-east-1\"\n\
         allow_http = true\n\
         [peers]\nmembers = [{members}]\nlisten = \"{addr}:{PEER_PORT}\"\nadvertise = \"{addr}:{PEER_PORT}\"\n\
         secret_file = \"{secret}\"\nconnect_timeout = \"200ms\"\nsuspect_for = \"1s\"\n{sections}",
        state = dir.path().join("state").display(),
        sock = socket.display(),
        bucket = rgw.bucket,
        members = members.join(", "),
        addr = Net::addr(i),
        secret = secret.display(),
    );
    std::fs::write(&config, text).unwrap();
    let daemon = Daemon::with_config_in(dir, config, socket, Some(net.ns(i)));
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    for (name, _, _) in mounts {
        let mnt = mnt_dir.path().join(name);
        while !mounted(&mnt) {
            assert!(std::time::Instant::now() < deadline, "node {i} never mounted {}\n{}", mnt.display(), daemon.log());
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    MountNode { daemon, mnt, mnt_dir }
}

/// Every file under `root`, with its size, as `find` and `stat` see them.
fn walk(root: &Path) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    let mut dirs = vec![root.to_path_buf()];
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(&d).unwrap_or_else(|e| panic!("{}: {e}", d.display())) {
            let e = e.unwrap();
            let meta = std::fs::metadata(e.path()).unwrap();
            if meta.is_dir() {
                dirs.push(e.path());
            } else {
                out.insert(e.path().strip_prefix(root).unwrap().display().to_string(), meta.len());
            }
        }
    }
    out
}

/// Walks every node's mount at once; each must see `want`.
fn walk_everywhere(nodes: &[&MountNode], want: &BTreeMap<String, u64>) {
    std::thread::scope(|s| {
        for n in nodes {
            s.spawn(|| assert_eq!(&walk(&n.mnt), want, "as listed on a node\n{}", n.daemon.log()));
        }
    });
}

/// The requests RGW answered, as `METHOD /path?query`, from its log.
fn rgw_requests() -> Vec<String> {
    let log = std::fs::read_to_string(std::env::var("STRATA_TEST_RGW_LOG").unwrap()).unwrap();
    log.lines()
        .filter(|l| l.contains(" beast: "))
        .filter_map(|l| Some(l.split('"').nth(1)?.split(' ').take(2).collect::<Vec<_>>().join(" ")))
        .collect()
}

/// The LISTs RGW answered for key prefix `prefix`: delimited (one directory level) or not
/// (a whole tree).
fn lists(rgw: &Rgw, prefix: &str, delimited: bool) -> usize {
    let encoded = prefix.replace('/', "%2F");
    rgw_requests()
        .iter()
        .filter(|r| r.starts_with(&format!("GET /{}?", rgw.bucket)) || r.starts_with(&format!("GET /{}/?", rgw.bucket)))
        .filter(|r| r.contains("delimiter=") == delimited)
        .filter(|r| r.split(['&', '?', ' ']).any(|p| p == format!("prefix={encoded}")))
        .count()
}

/// The delimited LISTs RGW answered for directory `dir/` (a key prefix).
fn lists_of(rgw: &Rgw, dir: &str) -> usize {
    lists(rgw, dir, true)
}

/// The HEADs RGW answered for `key`.
fn heads_of(rgw: &Rgw, key: &str) -> usize {
    rgw_requests().iter().filter(|r| **r == format!("HEAD /{}/{key}", rgw.bucket)).count()
}

#[test]
#[ignore = "needs root, network namespaces, FUSE and Ceph RGW: run by .ci/run"]
fn three_nodes_list_each_directory_once_for_the_cluster_within_the_ttl_and_survive_a_dead_owner() {
    let rgw = Rgw::from_env();
    let net = Net::new(NODES);
    let host = rgw.endpoint.trim_start_matches("http://").to_owned();
    let port = host.rsplit(':').next().unwrap().to_owned();
    let rgw_via = format!("198.18.0.1:{port}");
    relay(&rgw_via, host, Back::delay(Duration::from_millis(20)));
    for i in 0..NODES {
        net.wait_reaches(i, &rgw_via);
    }
    let prefix = unique_prefix("meta");
    let store = rgw.store();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let mut want = BTreeMap::new();
    for (d, dir) in DIRS.iter().enumerate() {
        for f in 0..20 {
            let bytes = data((d * 100 + f) as u64, 100 + f);
            let key = format!("{prefix}{dir}/file-{f:02}");
            rt.block_on(store.put(&object_store::path::Path::from(key.as_str()), bytes.into())).unwrap();
            want.insert(format!("{dir}/file-{f:02}"), (100 + f) as u64);
        }
    }
    let shared = tempfile::tempdir().unwrap();
    let secret = shared.path().join("peer-secret");
    std::fs::write(&secret, format!("{}\n", sha(b"this cluster's peer secret"))).unwrap();
    let mut nodes: Vec<MountNode> = (0..NODES).map(|i| node(i, &net, &rgw, &secret, &prefix, &rgw_via)).collect();

    // The nodes came up one after another, and each found the later ones down as it mounted:
    // they are suspect for a second, and the listings the mounts made alone expire.
    std::thread::sleep(TTL + Duration::from_millis(500));
    let dirs: Vec<String> =
        std::iter::once(prefix.clone()).chain(DIRS.iter().map(|d| format!("{prefix}{d}/"))).collect();
    let before: Vec<usize> = dirs.iter().map(|d| lists_of(&rgw, d)).collect();

    // A job starts on every node at once: each directory is listed from RGW once.
    walk_everywhere(&nodes.iter().collect::<Vec<_>>(), &want);
    std::thread::sleep(Duration::from_millis(500)); // RGW writes its log a moment after it answers
    for (dir, before) in dirs.iter().zip(before) {
        let listed = lists_of(&rgw, dir) - before;
        assert_eq!(listed, 1, "{dir} was listed {listed} times for three nodes");
    }
    let received: u64 =
        nodes.iter().map(|n| n.daemon.status()["peers"]["listings_received"].as_u64().unwrap_or(0)).sum();
    assert!(received >= DIRS.len() as u64, "the listings did not come from their owners: {received}");

    // A new object shows on every node once the TTL is over, never later.
    let key = format!("{prefix}a/new-file");
    rt.block_on(store.put(&object_store::path::Path::from(key.as_str()), b"new".to_vec().into())).unwrap();
    want.insert("a/new-file".into(), 3);
    std::thread::sleep(TTL + Duration::from_millis(200));
    walk_everywhere(&nodes.iter().collect::<Vec<_>>(), &want);

    // The owner of b/ dies: the others list it from the next choice, the right entries,
    // once between them.
    let members: Vec<Member> =
        (0..NODES).map(|j| Member { name: format!("{}:{PEER_PORT}", Net::addr(j)), weight: 1.0 }).collect();
    let b = format!("{}b", prefix);
    let owner = rank(&MetaRequest::list(&b, Duration::ZERO).placement(), &members)[0].name.clone();
    let dead = (0..NODES).find(|&j| members[j].name == owner).unwrap();
    let before = lists_of(&rgw, &format!("{b}/"));
    nodes[dead].daemon.kill9();
    let _ = std::process::Command::new("umount").args(["-l"]).arg(&nodes[dead].mnt).status();
    std::thread::sleep(TTL + Duration::from_millis(200));
    let alive: Vec<&MountNode> = nodes.iter().enumerate().filter(|(j, _)| *j != dead).map(|(_, n)| n).collect();
    walk_everywhere(&alive, &want);
    std::thread::sleep(Duration::from_millis(500));
    let after = lists_of(&rgw, &format!("{b}/"));
    assert_eq!(after - before, 1, "b/ was listed {} times by two nodes with its owner dead", after - before);
    delete_under(&rgw, &prefix);
}

#[test]
#[ignore = "needs root, network namespaces, FUSE and Ceph RGW: run by .ci/run"]
fn three_nodes_head_each_key_and_snapshot_each_prefix_once_for_the_cluster() {
    let rgw = Rgw::from_env();
    let net = Net::new(NODES);
    let host = rgw.endpoint.trim_start_matches("http://").to_owned();
    // A relay port of its own: the other test's relay may still listen in this process.
    let port = host.rsplit(':').next().unwrap().parse::<u16>().unwrap() + 1;
    let rgw_via = format!("198.18.0.1:{port}");
    relay(&rgw_via, host, Back::delay(Duration::from_millis(20)));
    for i in 0..NODES {
        net.wait_reaches(i, &rgw_via);
    }
    let prefix = unique_prefix("meta-head");
    let (named, snapped) = (format!("{prefix}named/"), format!("{prefix}snapped/"));
    let store = rgw.store();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let mut want = BTreeMap::new();
    for f in 0..20 {
        for under in [&named, &snapped] {
            let key = format!("{under}d{}/file-{f:02}", f % 2);
            rt.block_on(store.put(&object_store::path::Path::from(key.as_str()), data(f as u64, 50 + f).into()))
                .unwrap();
        }
        want.insert(format!("d{}/file-{f:02}", f % 2), (50 + f) as u64);
    }
    let shared = tempfile::tempdir().unwrap();
    let secret = shared.path().join("peer-secret");
    std::fs::write(&secret, format!("{}\n", sha(b"this cluster's peer secret"))).unwrap();
    let ttl = format!("metadata_ttl = \"{}s\"\n", TTL.as_secs());
    let mounts = [("named", named.as_str(), ttl.as_str()), ("snapped", snapped.as_str(), "snapshot = true\n")];
    let start = |i| node_with(i, &net, &rgw, &secret, &rgw_via, &mounts);
    let mut nodes: Vec<MountNode> = (0..NODES).map(start).collect();
    std::thread::sleep(TTL + Duration::from_millis(500));

    // Every node looks up each file by its name, as a loader that reads an index does, and
    // one name that is not there: RGW answers one HEAD for each key, for the three nodes.
    let keys: Vec<String> = want.keys().cloned().chain(["d0/missing".to_string()]).collect();
    let before: Vec<usize> = keys.iter().map(|k| heads_of(&rgw, &format!("{named}{k}"))).collect();
    std::thread::scope(|s| {
        for n in &nodes {
            let (keys, want) = (&keys, &want);
            s.spawn(move || {
                for k in keys {
                    match (std::fs::metadata(n.at("named").join(k)), want.get(k)) {
                        (Ok(m), Some(&len)) => assert_eq!(m.len(), len, "{k}"),
                        (Err(e), None) => assert_eq!(e.kind(), std::io::ErrorKind::NotFound, "{k}"),
                        (got, want) => panic!("{k}: {got:?}, where {want:?} was wanted\n{}", n.daemon.log()),
                    }
                }
            });
        }
    });
    std::thread::sleep(Duration::from_millis(500));
    for (k, before) in keys.iter().zip(before) {
        let heads = heads_of(&rgw, &format!("{named}{k}")) - before;
        assert_eq!(heads, 1, "{k} was HEAD'ed {heads} times for three nodes");
    }

    // Two nodes come back with empty state dirs: their mounts take the snapshot from the
    // prefix's owner, and RGW lists the prefix no more; what they show is the whole tree.
    let members: Vec<Member> =
        (0..NODES).map(|j| Member { name: format!("{}:{PEER_PORT}", Net::addr(j)), weight: 1.0 }).collect();
    let tree = MetaRequest { kind: MetaKind::Tree, path: snapped.clone(), max_age_ms: 0, max_missing_age_ms: None };
    let owner = rank(&tree.placement(), &members)[0].name.clone();
    let listed = lists(&rgw, &snapped, false);
    for j in (0..NODES).filter(|&j| members[j].name != owner) {
        nodes[j].daemon.kill9();
        for name in ["named", "snapped"] {
            let _ = std::process::Command::new("umount").args(["-l"]).arg(nodes[j].at(name)).status();
        }
        nodes[j] = start(j);
    }
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(lists(&rgw, &snapped, false), listed, "a node listed a snapshotted prefix its owner had");
    for n in &nodes {
        assert_eq!(walk(&n.at("snapped")), want, "as a snapshot shows it\n{}", n.daemon.log());
    }
    assert!(lists(&rgw, &snapped, false) >= 1, "the owner never listed the prefix for its snapshot");
    delete_under(&rgw, &prefix);
}
