//! One lazy image started on three nodes at once, through the peer tier: three `strata daemon`s
//! in network namespaces of their own on a Linux bridge, each with a containerd of its own,
//! against the real registry that `.ci/run` starts (reached through a relay on the bridge, with
//! a round trip's delay, since the registry listens on loopback). What a platform team rolling
//! an image out counts on: every container starts and prints its line; every chunk of every
//! layer is checked and cached on every node; and the registry serves the layers' bytes about
//! once for the cluster, as its own log shows, not once per node, whether the layers are lazy
//! or fetched whole.

mod common;

use common::containerd::{ranged_answers, registry, registry_log, served};
use common::netns::{Back, Net, relay};
use common::peer_node::ImageNode;
use common::sha;
use std::time::Duration;

const NODES: usize = 3;
/// Where the daemons reach the registry: a relay on the bridge.
const REGISTRY_VIA: &str = "198.18.0.1:5001";

/// The nodes on `net`, reaching the registry through a relay with a round trip's delay: one
/// relay for the process, which every test in it shares.
fn cluster(net: &Net) -> (Vec<ImageNode>, tempfile::TempDir) {
    static RELAY: std::sync::Once = std::sync::Once::new();
    RELAY.call_once(|| relay(REGISTRY_VIA, registry(), Back::delay(Duration::from_millis(20))));
    for i in 0..NODES {
        net.wait_reaches(i, REGISTRY_VIA);
    }
    let shared = tempfile::tempdir().unwrap();
    let secret = shared.path().join("peer-secret");
    std::fs::write(&secret, format!("{}\n", sha(b"this cluster's peer secret"))).unwrap();
    let nodes = (0..NODES).map(|i| ImageNode::start(i, NODES, net, &secret, REGISTRY_VIA)).collect();
    (nodes, shared)
}

#[test]
#[ignore = "needs root, network namespaces, containerd, ctr-remote and the test registry: run by .ci/run"]
fn three_nodes_start_one_lazy_image_at_once_and_the_registry_serves_its_layers_about_once() {
    let net = Net::new(NODES);
    let (nodes, _shared) = cluster(&net);
    let image = format!("{}/strata/python:esgz-opt", registry());
    let mark = registry_log().len();

    // Every node pulls and starts the image at once.
    let outputs: Vec<String> = std::thread::scope(|s| {
        let runs: Vec<_> = (0..NODES)
            .map(|i| {
                let (n, image) = (&nodes[i], &image);
                s.spawn(move || n.start_container(image, &format!("start-{i}"), "python3 -c 'print(1)'"))
            })
            .collect();
        runs.into_iter().map(|r| r.join().unwrap()).collect()
    });
    assert!(outputs.iter().all(|o| o == "1\n"), "{outputs:?}");

    // Every node mounted every layer lazily and brings all of it in; every chunk is checked
    // against its digest from the TOC before it is cached, and none failed.
    let reports: Vec<Vec<serde_json::Value>> = nodes.iter().map(|n| n.layers_done(Duration::from_secs(120))).collect();
    for (i, report) in reports.iter().enumerate() {
        for l in report {
            assert_eq!(l["lazy"], true, "node {i}: {l:#}");
            assert_eq!(l["chunks_cached"], l["chunks_total"], "node {i}: {l:#}");
        }
        let metrics = nodes[i].daemon.status();
        assert_eq!(metrics["peers"]["corrupt"], 0, "node {i}: {metrics:#}");
    }

    // And what a container reads of the layer is the same on every node: the chunks each node
    // decoded from segments of peers passed their digests, or the read would have failed.
    let script = "find /usr/lib/python3* -type f | sort | xargs cat | sha256sum";
    let sums: Vec<String> = std::thread::scope(|s| {
        let runs: Vec<_> = (0..NODES)
            .map(|i| {
                let (n, image) = (&nodes[i], &image);
                s.spawn(move || {
                    n.containerd.run_captured("strata", image, &format!("sum-{i}"), script, &n.daemon.log())
                })
            })
            .collect();
        runs.into_iter().map(|r| r.join().unwrap()).collect()
    });
    assert!(sums[0].len() > 64 && sums.iter().all(|s| *s == sums[0]), "{sums:?}");

    // The registry served each layer's bytes about once for the three nodes, its TOC
    // included: each segment of it was asked for once, by its owner. Without the peer tier,
    // each node would have fetched every layer whole: three times its size.
    for l in &reports[0] {
        let digest = l["layer"].as_str().unwrap();
        let size = l["blob_size"].as_u64().unwrap();
        let answers = ranged_answers(mark, digest);
        let served: u64 = answers.iter().sum();
        let segments = size.div_ceil(strata_snapshotter::peer_blobs::SEGMENT) as usize;
        eprintln!("layer {digest}: the registry served {served} bytes of {size} to {NODES} nodes");
        assert!(
            served as f64 <= 1.1 * size as f64,
            "the registry served {served} bytes of layer {digest} ({size} bytes) to three nodes"
        );
        assert!(
            answers.len() <= segments,
            "{} ranged reads of layer {digest} for three nodes, of {segments} segments: a TOC was read by more than one",
            answers.len()
        );
    }
    let peers: Vec<serde_json::Value> = nodes.iter().map(|n| n.daemon.status()["peers"].clone()).collect();
    let received: u64 = peers.iter().map(|p| p["received_bytes"].as_u64().unwrap()).sum();
    let size: u64 = reports[0].iter().map(|l| l["blob_size"].as_u64().unwrap()).sum();
    assert!(received >= size, "the nodes got {received} bytes from peers, of layers of {size}: {peers:#?}");
}

#[test]
#[ignore = "needs root, network namespaces, containerd, ctr-remote and the test registry: run by .ci/run"]
fn three_nodes_fetch_a_plain_images_layers_whole_through_the_peer_tier_about_once() {
    let net = Net::new(NODES);
    let (nodes, _shared) = cluster(&net);
    // Not eStargz: Strata fetches each layer whole, checks its digest and unpacks it.
    let image = format!("{}/strata/busybox:1", registry());
    let mark = registry_log().len();
    let outputs: Vec<String> = std::thread::scope(|s| {
        let runs: Vec<_> = (0..NODES)
            .map(|i| {
                let (n, image) = (&nodes[i], &image);
                s.spawn(move || n.start_container(image, &format!("whole-{i}"), "echo whole"))
            })
            .collect();
        runs.into_iter().map(|r| r.join().unwrap()).collect()
    });
    assert!(outputs.iter().all(|o| o == "whole\n"), "{outputs:?}");
    let report = nodes[0].layers();
    assert!(!report.is_empty() && report.iter().all(|l| l["how"] == "whole"), "{report:#?}");
    for l in &report {
        let digest = l["layer"].as_str().unwrap();
        let size = l["blob_size"].as_u64().unwrap();
        let sent = served(mark, digest);
        eprintln!("layer {digest}: the registry sent {sent} bytes of {size} to {NODES} nodes");
        assert!(sent >= size, "the registry's log shows {sent} bytes of layer {digest} ({size}): it cannot be counted");
        assert!(
            sent as f64 <= 1.1 * size as f64,
            "the registry sent {sent} bytes of layer {digest} ({size} bytes) to three nodes"
        );
    }
    let received: u64 = nodes.iter().map(|n| n.daemon.status()["peers"]["received_bytes"].as_u64().unwrap()).sum();
    assert!(received > 0, "no node got a layer's bytes from a peer");
}
