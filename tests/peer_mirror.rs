//! The registry mirror on every node: three `strata daemon`s in network namespaces of their own
//! on a Linux bridge, each serving `[mirror]` to a containerd of its own, which pulls plain
//! (not lazy) images onto overlayfs with the node's mirror in its `hosts.toml`. Against the
//! real registry that `.ci/run` starts, reached through relays on the bridge. What a platform
//! team counts on: every pull works and its containers run; the registry serves each blob about
//! once for the three nodes, not once per node; and a private repository is refused to a
//! client without its login and served to one with it.

mod common;

use common::auth_registry::{Auth, AuthRegistry, PASSWORD, USER};
use common::containerd::{MANIFEST_ACCEPT, image_blobs, registry, registry_log, served};
use common::netns::{Back, Net, relay};
use common::peer_node::{ImageNode, MIRROR_PORT, mirror_hosts};
use common::sha;
use std::path::Path;
use std::time::Duration;

const NODES: usize = 3;
/// Where the daemons reach the test registry, and the one behind a login: relays on the bridge.
const REGISTRY_VIA: &str = "198.18.0.1:5001";
const PRIVATE_VIA: &str = "198.18.0.1:5002";
/// The mirrors' access TTL: a tag is resolved once per period of it for the cluster.
const TAG_TTL_SECS: u64 = 3600;

fn nodes(net: &Net, routes: &[(String, String)]) -> (Vec<ImageNode>, tempfile::TempDir) {
    let shared = tempfile::tempdir().unwrap();
    let secret = shared.path().join("peer-secret");
    std::fs::write(&secret, format!("{}\n", sha(b"this cluster's peer secret"))).unwrap();
    let nodes = (0..NODES)
        .map(|i| {
            let mirror =
                format!("[mirror]\nlisten = \"{}:{MIRROR_PORT}\"\naccess_ttl = \"{TAG_TTL_SECS}s\"\n", Net::addr(i));
            ImageNode::start_with(i, NODES, net, &secret, routes, &mirror)
        })
        .collect();
    (nodes, shared)
}

/// The digest of the manifest `repo:tag` at the test registry.
fn manifest_digest(repo: &str, tag: &str) -> String {
    manifest_digest_and_size(repo, tag).0
}

/// The digest and size of the manifest `repo:tag` at the test registry.
fn manifest_digest_and_size(repo: &str, tag: &str) -> (String, u64) {
    let url = format!("http://{}/v2/{repo}/manifests/{tag}", registry());
    let out = std::process::Command::new("curl").args(["-fsSI", "-H", MANIFEST_ACCEPT, &url]).output().unwrap();
    let head = String::from_utf8(out.stdout).unwrap();
    let header = |name: &str| {
        let line = head.lines().find(|l| l.to_ascii_lowercase().starts_with(name)).unwrap();
        line.split_once(':').unwrap().1.trim().to_owned()
    };
    (header("docker-content-digest:"), header("content-length:").parse().unwrap())
}

/// `ctr images pull` on node `n` through hosts dir `hosts`, with `login` if given.
fn pull(n: &ImageNode, hosts: &Path, image: &str, login: Option<&str>) -> std::process::Output {
    let hosts = hosts.display().to_string();
    let mut args = vec!["images", "pull", "--hosts-dir", &hosts];
    if let Some(l) = login {
        args.extend(["--user", l]);
    }
    args.push(image);
    n.containerd.ctr(&args)
}

#[test]
#[ignore = "needs root, network namespaces, containerd and the test registry: run by .ci/run"]
fn three_nodes_pull_one_image_through_their_mirrors_and_the_registry_serves_each_blob_once() {
    let net = Net::new(NODES);
    relay(REGISTRY_VIA, registry(), Back::delay(Duration::from_millis(20)));
    for i in 0..NODES {
        net.wait_reaches(i, REGISTRY_VIA);
    }
    let (nodes, dir) = nodes(&net, &[(registry(), REGISTRY_VIA.to_owned())]);
    let image = format!("{}/strata/busybox:1", registry());
    let mark = registry_log().len();
    let period =
        || std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs() / TAG_TTL_SECS;
    let first_period = period();
    std::thread::scope(|s| {
        for (i, n) in nodes.iter().enumerate() {
            let (image, hosts) = (&image, mirror_hosts(dir.path(), i, &registry()));
            s.spawn(move || {
                let out = pull(n, &hosts, image, None);
                assert!(
                    out.status.success(),
                    "pull on node {i}: {}\n{}",
                    String::from_utf8_lossy(&out.stderr),
                    n.daemon.log()
                );
                let said =
                    n.containerd.run_captured("overlayfs", image, &format!("m-{i}"), "echo mirrored", &n.daemon.log());
                assert_eq!(said, "mirrored\n", "node {i}");
            });
        }
    });
    // The tag was resolved at the registry once for the three nodes (twice, had a TTL period
    // ended during the pulls), by its owner.
    let periods = (period() - first_period + 1) as usize;
    // Counted before this test asks for the tag itself.
    let tag_asks = registry_log()[mark..]
        .lines()
        .filter(|l| l.contains("/v2/strata/busybox/manifests/1 ") && (l.contains("\"HEAD ") || l.contains("\"GET ")))
        .count();
    assert!(tag_asks <= periods, "the registry resolved the tag {tag_asks} times for three nodes");
    assert!(tag_asks >= 1, "no request for the tag in the registry's log: the count above cannot be trusted");
    // containerd checks each blob against its digest; the registry sent each about once.
    let blobs = image_blobs("strata/busybox", "1");
    for (digest, size) in &blobs {
        let sent = served(mark, digest);
        eprintln!("layer {digest}: the registry sent {sent} bytes of {size} to {NODES} nodes");
        assert!(sent as f64 <= 1.25 * *size as f64, "the registry sent {sent} bytes of {digest} ({size} bytes)");
    }
    // The manifest, by digest, came from the registry once for the three nodes too.
    let (manifest, manifest_size) = manifest_digest_and_size("strata/busybox", "1");
    let gets = registry_log()[mark..]
        .lines()
        .filter(|l| l.contains("\"GET /v2/strata/busybox/manifests/") && l.contains(&format!("/{manifest} ")))
        .count();
    assert_eq!(gets, 1, "the registry was asked for manifest {manifest} {gets} times for three nodes");
    let total: u64 = blobs.iter().map(|(_, s)| s).sum::<u64>() + manifest_size;
    let from_peers: u64 = (0..NODES).map(|i| nodes[i].counter(i, "strata_mirror_peer_bytes")).sum();
    assert_eq!(from_peers, NODES as u64 * total, "every node's mirror served the manifest and every blob from peers");
}

#[test]
#[ignore = "needs root, network namespaces, containerd and the test registry: run by .ci/run"]
fn a_private_repository_is_refused_without_its_login_and_served_with_it() {
    let private = AuthRegistry::start(Auth::Basic);
    let net = Net::new(NODES);
    relay(PRIVATE_VIA, private.addr.clone(), Back::delay(Duration::from_millis(5)));
    net.wait_reaches(0, PRIVATE_VIA);
    let (nodes, dir) = nodes(&net, &[(private.addr.clone(), PRIVATE_VIA.to_owned())]);
    // By digest: containerd asks a pull-only mirror for manifests by digest, and a tag only
    // of the registry, which refuses it there without a login before the mirror is asked.
    let image = format!("{}/strata/busybox@{}", private.addr, manifest_digest("strata/busybox", "1"));
    let hosts = mirror_hosts(dir.path(), 0, &private.addr);
    let n = &nodes[0];

    let out = pull(n, &hosts, &image, None);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && stderr.contains("401"), "pulled without a login: {stderr}");
    assert!(n.counter(0, "strata_mirror_refused") >= 1, "the mirror did not refuse: {}", n.metrics_text(0));

    let login = format!("{USER}:{PASSWORD}");
    let out = pull(n, &hosts, &image, Some(&login));
    assert!(out.status.success(), "pull with the login: {}\n{}", String::from_utf8_lossy(&out.stderr), n.daemon.log());
    let said = n.containerd.run_captured("overlayfs", &image, "private", "echo private", &n.daemon.log());
    assert_eq!(said, "private\n");
    // The nodes hold no login of their own for it, so the blobs were passed on with the
    // client's, not taken from peers.
    assert!(n.counter(0, "strata_mirror_upstream_bytes") > 0, "{}", n.metrics_text(0));
    assert_eq!(n.counter(0, "strata_mirror_peer_bytes"), 0);
}
