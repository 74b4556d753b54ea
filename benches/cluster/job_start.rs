//! Workload (j), a job start: every node mounts the same dataset of many small objects (100k
//! by default) and walks it with `find` and `stat`; then every node looks up the same sample of
//! keys by name on a second mount of it, as a loader reading an index does. From RGW's own log:
//! the delimited LISTs per directory (goal: 1 for the cluster), and the HEADs per key looked up
//! by name (goal: ≤ 1.1); and the walk's time against N = 1.

use super::origin_log::{Mark, list_prefix};
use super::{Setup, node_with};
use crate::common::mount::mounted;
use crate::common::netns::Net;
use crate::common::{Daemon, data};
use futures::StreamExt;
use object_store::ObjectStoreExt;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

/// Objects per directory: one page of a LIST.
const PER_DIR: usize = 500;
const OBJECT_BYTES: usize = 256;

pub struct Dataset {
    prefix: String,
    objects: usize,
    /// The keys every node looks up by name, relative to the dataset.
    named: Vec<String>,
}

/// Puts `objects` small objects under `prefix`, in directories of [`PER_DIR`].
pub fn put(s: &Setup, prefix: &str, objects: usize, named: usize) -> Dataset {
    let prefix = format!("{prefix}job/");
    let store = s.rgw.store();
    let rel = |k: usize| format!("d{:04}/f{:05}", k / PER_DIR, k);
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let started = Instant::now();
    rt.block_on(
        futures::stream::iter(0..objects)
            .map(|k| {
                let (store, key) = (store.clone(), format!("{prefix}{}", rel(k)));
                async move {
                    let bytes = data(k as u64, OBJECT_BYTES);
                    store.put(&object_store::path::Path::from(key.as_str()), bytes.into()).await.unwrap();
                }
            })
            .buffer_unordered(32)
            .collect::<Vec<()>>(),
    );
    eprintln!("cluster: (j) put {objects} objects in {:.0} s", started.elapsed().as_secs_f64());
    // Spread over the dataset, so the sample's lookups cross many directories.
    let step = (objects / named.max(1)).max(1);
    let named = (0..objects).step_by(step).take(named).map(rel).collect();
    Dataset { prefix, objects, named }
}

pub struct Row {
    pub n: usize,
    /// Directories listed, and the most LISTs any of them took.
    pub dirs: usize,
    pub lists_max: usize,
    pub lists_total: usize,
    /// Keys HEAD'ed by name, and the HEADs.
    pub head_keys: usize,
    pub heads: usize,
    pub walk_secs: f64,
    /// The share of the machine's cores that were busy during the walk.
    pub busy: f64,
}

/// Workload (j) on `n` fresh nodes.
pub fn run(s: &Setup, net: &Net, n: usize, d: &Dataset) -> Row {
    let mounts: Vec<tempfile::TempDir> = (0..n).map(|_| tempfile::tempdir().unwrap()).collect();
    let nodes: Vec<Daemon> = (0..n)
        .map(|i| {
            let root = mounts[i].path();
            let section = |name: &str| {
                format!(
                    "[[mounts]]\npath = \"{}\"\nprefix = \"{}\"\nread_only = true\nmetadata_ttl = \"10m\"\n",
                    root.join(name).display(),
                    d.prefix.trim_end_matches('/')
                )
            };
            // Members found down while the nodes came up one by one are skipped for a
            // moment only: the walk measures the cluster once it is whole.
            let extra = format!("suspect_for = \"2s\"\n{}{}", section("walk"), section("named"));
            node_with(i, n, net, s, None, &extra)
        })
        .collect();
    for (i, node) in nodes.iter().enumerate() {
        wait_mounted(node, &mounts[i].path().join("walk"));
        wait_mounted(node, &mounts[i].path().join("named"));
    }
    std::thread::sleep(Duration::from_secs(3));

    let rgw_log = Mark::now("STRATA_TEST_RGW_LOG");
    let (start, cores) = (Instant::now(), super::cpu::Cores::now());
    std::thread::scope(|sc| {
        for (i, m) in mounts.iter().enumerate() {
            let (root, node) = (m.path().join("walk"), &nodes[i]);
            sc.spawn(move || {
                let (count, bytes) = walk(&root);
                let want = (d.objects, (d.objects * OBJECT_BYTES) as u64);
                assert_eq!((count, bytes), want, "node {i}'s walk: files and bytes\n{}", node.log());
            });
        }
    });
    let (walk_secs, busy) = (start.elapsed().as_secs_f64(), cores.busy_since());
    let mut lists: HashMap<String, usize> = HashMap::new();
    for r in rgw_log.requests() {
        if r.starts_with(&format!("GET /{}", s.rgw.bucket)) && r.contains("delimiter=") {
            *lists.entry(list_prefix(&r).unwrap_or_default()).or_default() += 1;
        }
    }

    let rgw_log = Mark::now("STRATA_TEST_RGW_LOG");
    std::thread::scope(|sc| {
        for (i, m) in mounts.iter().enumerate() {
            let root = m.path().join("named");
            for part in d.named.chunks(d.named.len().div_ceil(4).max(1)) {
                let (root, node) = (root.clone(), &nodes[i]);
                sc.spawn(move || {
                    for k in part {
                        let meta = std::fs::metadata(root.join(k));
                        let len = meta.unwrap_or_else(|e| panic!("node {i}: {k}: {e}\n{}", node.log())).len();
                        assert_eq!(len, OBJECT_BYTES as u64, "node {i}: {k}");
                    }
                });
            }
        }
    });
    let mut heads: HashMap<String, usize> = HashMap::new();
    for r in rgw_log.requests() {
        if let Some(key) = r.strip_prefix(&format!("HEAD /{}/", s.rgw.bucket)) {
            *heads.entry(key.to_owned()).or_default() += 1;
        }
    }
    let row = Row {
        n,
        dirs: lists.len(),
        lists_max: lists.values().copied().max().unwrap_or(0),
        lists_total: lists.values().sum(),
        head_keys: heads.len(),
        heads: heads.values().sum(),
        walk_secs,
        busy,
    };
    eprintln!(
        "cluster: (j) N={n}: walk {walk_secs:.1} s; {} LISTs of {} directories (at most {}); {} HEADs of {} keys",
        row.lists_total, row.dirs, row.lists_max, row.heads, row.head_keys
    );
    drop(nodes);
    row
}

fn wait_mounted(node: &Daemon, mnt: &Path) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !mounted(mnt) {
        assert!(Instant::now() < deadline, "{} never mounted\n{}", mnt.display(), node.log());
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// `find` and `stat` of every file under `root`: how many, and their bytes.
fn walk(root: &PathBuf) -> (usize, u64) {
    let out = Command::new("find").arg(root).args(["-type", "f", "-printf", "%s\\n"]).output().unwrap();
    assert!(out.status.success(), "find {}: {}", root.display(), String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout).unwrap();
    let sizes: Vec<u64> = text.lines().map(|l| l.parse().unwrap()).collect();
    (sizes.len(), sizes.iter().sum())
}

pub fn render(rows: &[Row], objects: usize, named: usize) -> String {
    let mut t = format!(
        "\nJob start (j): {objects} objects in directories of {PER_DIR}, `find` and `stat` on every node at once, \
         then {named} keys looked up by name on every node. Counted in RGW's log.\n\n\
         | N | directories listed | LISTs per directory (max) | LISTs ÷ directories | HEADs ÷ keys looked up | walk ÷ walk at N=1 | cores busy | walk (s) |\n\
         |---|---|---|---|---|---|---|---|\n"
    );
    let base = rows.iter().find(|r| r.n == 1).map(|r| r.walk_secs);
    for r in rows {
        let rel = base.map_or("–".into(), |b| format!("{:.2}", r.walk_secs / b));
        t += &format!(
            "| {} | {} | {} | {:.3} | {:.3} | {rel} | {:.0}% | {:.1} |\n",
            r.n,
            r.dirs,
            r.lists_max,
            r.lists_total as f64 / r.dirs.max(1) as f64,
            r.heads as f64 / r.head_keys.max(1) as f64,
            r.busy * 100.0,
            r.walk_secs
        );
    }
    t
}
