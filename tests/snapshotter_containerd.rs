//! Strata's snapshotter under a real containerd 1.6 (as its `strata` proxy plugin), with real
//! runc containers and images pulled from the real registry that `.ci/run` starts. Needs root,
//! so these are ignored in a plain `cargo test` and run by `.ci/run`.

mod common;

use common::auth_registry::{Auth, AuthRegistry, PASSWORD, USER};
use common::containerd::{Containerd, ranged_answers, registry, registry_log};
use common::faulty::{Fault, FaultyRegistry};
use common::node::Node;
use common::*;
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The snapshot directories under the snapshotter's root, by id.
fn layer_dirs(root: &Path) -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(root.join("snapshots"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.file_name().unwrap().to_str().unwrap().parse::<u64>().is_ok())
        .collect();
    dirs.sort();
    dirs
}

/// containerd removes a backend's snapshots in its garbage collector, shortly after the
/// removal it was asked for.
fn wait_for_layer_dirs(node: &Node, n: usize) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while layer_dirs(&node.snapshots_root()).len() != n {
        assert!(
            std::time::Instant::now() < deadline,
            "{:?} is not {n} snapshot dirs after 20s\n{}",
            layer_dirs(&node.snapshots_root()),
            node.daemon.log()
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

#[test]
#[ignore = "needs root, containerd, runc and the test registry: run by .ci/run"]
fn containerd_pulls_and_runs_an_image_on_strata_snapshots() {
    let node = Node::start();
    let image = node.pull();

    // containerd unpacked both layers into Strata's directories, as it does into overlayfs's:
    // the second layer holds its file and the whiteout that deletes /bin/vi.
    let layers = layer_dirs(&node.snapshots_root());
    let listed = node.ctr(&["snapshots", "--snapshotter", "strata", "ls"]);
    assert_eq!(layers.len(), 2, "{layers:?}\n{listed}\n{}", node.daemon.log());
    assert!(layers[0].join("fs/bin/busybox").is_file());
    assert_eq!(std::fs::read(layers[1].join("fs/etc/motd")).unwrap(), b"strata layer two\n");
    let vi = std::fs::symlink_metadata(layers[1].join("fs/bin/vi")).unwrap();
    assert!(vi.file_type().is_char_device(), "an overlay whiteout (0/0 char device) hides /bin/vi");
    let committed: Vec<&str> = listed.lines().filter(|l| l.contains("Committed")).collect();
    assert_eq!(committed.len(), 2, "{listed}");

    // A container on them: its root is an overlay of Strata's dirs, nearest layer first, and
    // it sees the image as an unpack would give it.
    let out = node.run_sh(
        &image,
        "pull-and-run",
        "cat /etc/motd; ls /bin/vi 2>/dev/null || echo no-vi; echo written >/tmp/f && cat /tmp/f; \
         grep ' / / ' /proc/self/mountinfo",
    );
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(&lines[..3], &["strata layer two", "no-vi", "written"], "{out}");
    let root = node.snapshots_root().join("snapshots");
    let lower = format!("lowerdir={}:{}", layers[1].join("fs").display(), layers[0].join("fs").display());
    assert!(lines[3].contains(" overlay ") && lines[3].contains(&lower), "{}", lines[3]);
    assert!(lines[3].contains(&format!("upperdir={}/", root.display())), "{}", lines[3]);
    // --rm let containerd's garbage collector remove the container's snapshot from Strata.
    wait_for_layer_dirs(&node, 2);

    let metrics = node.daemon.metrics_text();
    for method in ["prepare", "commit", "stat", "mounts", "remove"] {
        let line = format!("strata_snapshotter_requests_total{{method=\"{method}\",code=\"ok\"}}");
        assert!(metrics.contains(&line), "{line} missing:\n{metrics}");
    }

    // Removing the image lets containerd's garbage collector remove its snapshots from Strata.
    node.ctr(&["images", "rm", "--sync", &image]);
    wait_for_layer_dirs(&node, 0);
    let listed = node.ctr(&["snapshots", "--snapshotter", "strata", "ls"]);
    assert_eq!(listed.lines().count(), 1, "only the header is left:\n{listed}");
}

#[test]
#[ignore = "needs root, containerd, runc and the test registry: run by .ci/run"]
fn a_killed_daemon_restarts_with_its_snapshots_and_containers_keep_working() {
    let mut node = Node::start();
    let image = node.pull();
    node.ctr(&["run", "-d", "--snapshotter", "strata", &image, "long", "sleep", "600"]);
    let before = node.ctr(&["snapshots", "--snapshotter", "strata", "ls"]);

    node.daemon.kill9();
    node.daemon.spawn();

    node.containerd.wait_for_strata(std::time::Duration::from_secs(15));
    let after = node.ctr(&["snapshots", "--snapshotter", "strata", "ls"]);
    assert_eq!(after, before);
    let out = node.ctr(&["tasks", "exec", "--exec-id", "probe", "long", "cat", "/etc/motd"]);
    assert_eq!(out, "strata layer two\n", "the running container kept its rootfs");
    let out = node.run_out(&image, "after-restart", &["echo", "started"]);
    assert_eq!(out, "started\n");
}

/// Replaces RFC 3339 times (`2026-11-30T06:53:17Z`, as in ctr's `containerd.io/gc.root`
/// labels) with `TIME`.
fn mask_times(text: &str) -> String {
    let b = text.as_bytes();
    let shape = b"dddd-dd-ddTdd:dd:ddZ";
    let mut out = String::new();
    let mut i = 0;
    while i < b.len() {
        let fits = b.len() - i >= shape.len()
            && shape.iter().zip(&b[i..]).all(|(s, c)| if *s == b'd' { c.is_ascii_digit() } else { s == c });
        if fits {
            out.push_str("TIME");
            i += shape.len();
        } else {
            out.push(b[i] as char);
            i += 1;
        }
    }
    out
}

/// Runs one script of `ctr snapshots` commands against a snapshotter and records what each
/// one answered, with the snapshotter's root and the times taken out. The one successful
/// removal comes last: it wakes containerd's garbage collector, which takes snapshots that no
/// lease or root label holds, such as `ctr`'s views once the command is over.
fn snapshot_script(containerd: &Containerd, snapshotter: &str, root: &Path) -> Vec<String> {
    // containerd also collects once, 100 ms after it starts (its scheduler's startup_delay):
    // let that pass first.
    std::thread::sleep(std::time::Duration::from_secs(1));
    let steps: &[&[&str]] = &[
        &["prepare", "a"],
        &["prepare", "a"],
        &["commit", "layer1", "a"],
        &["prepare", "b", "layer1"],
        &["prepare", "c", "missing"],
        &["view", "v", "layer1"],
        &["commit", "layer2", "v"],
        &["commit", "layer2", "b"],
        &["prepare", "b2", "b"],
        &["prepare", "top", "layer2"],
        &["view", "v2", "layer2"],
        &["label", "layer1", "team=ml"],
        &["label", "layer1", "team="],
        &["label", "layer2", "keep=1"],
        &["rm", "layer1"],
        &["rm", "missing"],
        &["mounts", "/target", "top"],
        &["mounts", "/target", "v"],
        &["mounts", "/target", "v2"],
        &["mounts", "/target", "layer2"],
        &["usage", "layer1"],
        &["info", "layer2"],
        &["ls"],
        &["tree"],
        &["rm", "v"],
    ];
    let root = root.display().to_string();
    let mut record = Vec::new();
    for step in steps {
        let mut args = vec!["snapshots", "--snapshotter", snapshotter];
        args.extend_from_slice(step);
        let out = containerd.ctr(&args);
        let text = if out.status.success() {
            mask_times(&String::from_utf8_lossy(&out.stdout).replace(&root, "ROOT"))
        } else {
            // containerd appends the error class (from the gRPC code) to the message; the words
            // before it are each snapshotter's own.
            let err = String::from_utf8_lossy(&out.stderr).trim().to_string();
            format!("error: {}", err.rsplit(": ").next().unwrap())
        };
        let text: String = text
            .lines()
            .filter(|l| !l.contains("\"Created\"") && !l.contains("\"Updated\""))
            .map(|l| {
                // `ctr snapshots label` prints a map, in no fixed order.
                if step[0] == "label" {
                    let mut pairs: Vec<&str> = l.split(',').collect();
                    pairs.sort();
                    pairs.join(",")
                } else {
                    l.to_string()
                }
            })
            .collect::<Vec<_>>()
            .join("\n");
        record.push(format!("{step:?} -> {text}"));
    }
    record
}

#[test]
#[ignore = "needs root, containerd, runc and the test registry: run by .ci/run"]
fn snapshot_commands_answer_as_containerds_overlayfs_does() {
    let node = Node::start();
    let ours = snapshot_script(&node.containerd, "strata", &node.snapshots_root());
    // containerd's own overlayfs snapshotter, in a containerd of its own, so that neither
    // run's garbage collection reaches into the other's.
    let other = tempfile::tempdir().unwrap();
    let reference = Containerd::start(other.path(), &other.path().join("unused.sock"));
    let overlayfs_root = other.path().join("root/io.containerd.snapshotter.v1.overlayfs");
    let theirs = snapshot_script(&reference, "overlayfs", &overlayfs_root);
    assert!(theirs.iter().any(|l| l.contains("overlay") && l.contains("lowerdir=")), "{theirs:#?}");
    assert!(theirs.iter().any(|l| l.contains("error: already exists")), "{theirs:#?}");
    assert!(theirs.iter().any(|l| l.contains("v2     layer2 View")), "{theirs:#?}");
    assert_eq!(ours, theirs, "strata answered differently from overlayfs");
}

/// Where the registry's log ends now, so a test counts only the requests made after it.
fn log_mark() -> usize {
    registry_log().len()
}

/// Whole-blob downloads (status 200) of `digest` in the registry's log since `mark`: what
/// containerd does for a layer it has to fetch. Strata's own reads are ranged (206).
fn whole_downloads(mark: usize, digest: &str) -> usize {
    let blob = format!("/blobs/{digest} ");
    registry_log()[mark..]
        .lines()
        .filter(|l| l.contains("\"GET /v2/strata/") && l.contains(&blob) && l.contains("\" 200 "))
        .count()
}

fn lazy_mounts() -> Vec<String> {
    std::fs::read_to_string("/proc/mounts")
        .unwrap()
        .lines()
        .filter(|l| l.starts_with("strata:") && l.contains("/strata/busybox:esgz@"))
        .map(str::to_string)
        .collect()
}

#[test]
#[ignore = "needs root, containerd, runc, ctr-remote and the test registry: run by .ci/run"]
fn an_estargz_image_pulls_lazily_and_runs() {
    let node = Node::start();
    let mark = log_mark();
    let mounts_before = lazy_mounts().len();
    let image = node.rpull("busybox:esgz");
    let layers = node.layer_digests("busybox:esgz");

    // Each layer is a FUSE mount of Strata's, and containerd downloaded none of them.
    let ours: Vec<String> =
        lazy_mounts().into_iter().filter(|l| l.contains(&node.snapshots_root().display().to_string())).collect();
    assert_eq!(ours.len(), 2, "{ours:#?}");
    for d in &layers {
        assert!(ours.iter().any(|l| l.contains(d.as_str())), "no mount of {d}: {ours:#?}");
        assert_eq!(whole_downloads(mark, d), 0, "containerd downloaded layer {d}");
    }
    let metrics = node.daemon.metrics_text();
    assert!(metrics.contains("strata_snapshotter_layers_total{how=\"lazy\"} 2"), "{metrics}");
    // The second layer's TOC was read while containerd prepared the first.
    let log = node.daemon.log();
    let second = log.lines().find(|l| l.contains("layer mounted lazily") && l.contains(&layers[1])).unwrap();
    assert!(second.contains("toc_read_ahead=true"), "{second}");

    let out = node.run_sh(
        &image,
        "lazy-run",
        "cat /etc/motd; ls /bin/vi 2>/dev/null || echo no-vi; busybox | head -1 | cut -d' ' -f1",
    );
    assert_eq!(out, "strata layer two\nno-vi\nBusyBox\n");
    for d in &layers {
        assert_eq!(whole_downloads(mark, d), 0, "layer {d} was read in ranges only");
    }
    // Layers never change, so their mounts take no open or close: the container read its files
    // without one open reaching the daemon.
    let metrics = node.daemon.metrics_text();
    let opens: Vec<&str> = metrics.lines().filter(|l| l.starts_with("strata_fs_opens_total")).collect();
    assert!(opens.iter().all(|l| l.ends_with(" 0")), "{opens:?}");
    assert!(mounts_before <= lazy_mounts().len());

    // `strata image layers`: both lazy; the background fill brings every chunk in, and each
    // chunk's bytes came from the registry once.
    for d in &layers {
        let l = node.layer_when(d, |l| l["background"] == "done");
        assert_eq!(l["lazy"], true);
        assert_eq!(l["prefetch"], "none", "ctr-remote wrote .no.prefetch.landmark");
        assert_eq!(l["chunks_cached"], l["chunks_total"], "{l:#}");
        let (fetched, size) = (l["fetched_bytes"].as_u64().unwrap(), l["blob_size"].as_u64().unwrap());
        assert!(fetched > 0 && fetched <= size, "fetched {fetched} of {size}");
    }
    let out = std::process::Command::new(BIN)
        .args(["image", "layers", "--socket"])
        .arg(&node.daemon.socket)
        .output()
        .unwrap();
    let table = String::from_utf8(out.stdout).unwrap();
    assert!(table.contains("lazy") && table.contains(&layers[0]["sha256:".len()..][..12]), "{table}");
}

#[test]
#[ignore = "needs root, containerd, runc, ctr-remote and the test registry: run by .ci/run"]
fn the_prefetch_region_is_fetched_in_one_read_and_serves_the_start() {
    // No background fill, so only the prefetch and the container's own reads fetch anything.
    let node = Node::start_with("background_fetch = false");
    let mark = log_mark();
    let image = node.rpull("busybox:esgz-prefetch");
    let layers = node.layer_digests("busybox:esgz-prefetch");

    // Running busybox needs nothing of the base layer beyond its prefetch region: the one
    // ranged read of it is all the layer fetched.
    let out = node.run_out(&image, "prefetched", &["busybox", "echo", "hi"]);
    assert_eq!(out, "hi\n");
    let reports = node.layers_report();
    let base = reports.iter().find(|l| l["layer"] == layers[0].as_str()).unwrap_or_else(|| panic!("{reports:#?}"));
    assert_eq!(base["prefetch"], "done", "the container read busybox once its prefetch was in: {base:#}");
    let prefetch = base["prefetch_bytes"].as_u64().unwrap();
    let fetched = base["fetched_bytes"].as_u64().unwrap();
    assert!(fetched > 0 && fetched <= prefetch, "the prefetch region, and no more: {base:#}");
    assert!(prefetch > std::fs::metadata("/bin/busybox").unwrap().len() / 4, "busybox precedes the landmark");
    // It was asked for while the TOC was still being parsed, from where the landmark entry
    // alone says the region ends: that request starts at byte 0, so its answer is exactly the
    // region (a request made after the parse starts at the first file's data instead).
    let answers = ranged_answers(mark, &layers[0]);
    assert!(answers.contains(&prefetch), "one answer of {prefetch} bytes among {answers:?}");
}

/// `strata_snapshotter_prefetch_wait_seconds`: how many container starts waited, and how long
/// in all.
fn prefetch_waits(node: &Node) -> (u64, f64) {
    let metrics = node.daemon.metrics_text();
    let value = |name: &str| {
        metrics.lines().find_map(|l| l.strip_prefix(name)).and_then(|v| v.trim().parse::<f64>().ok()).unwrap_or(0.0)
    };
    (
        value("strata_snapshotter_prefetch_wait_seconds_count ") as u64,
        value("strata_snapshotter_prefetch_wait_seconds_sum "),
    )
}

/// Once `layer`'s prefetch is done, checks that the layer fetched no more than its region: no
/// read fetched a chunk of it a second time.
fn region_fetched_once(node: &Node, layer: &str) {
    let base = node.layer_when(layer, |l| l["prefetch"] == "done");
    let (fetched, region) = (base["fetched_bytes"].as_u64().unwrap(), base["prefetch_bytes"].as_u64().unwrap());
    assert!(fetched <= region, "no second fetch: {base:#}");
}

/// Runs `busybox echo hi` in a new container of `image` on `node` while watching containerd's tasks
/// and the layer's prefetch: whether the container's task was seen while the prefetch was
/// still on the wire. The run's output is checked.
fn task_seen_before_prefetch(node: &Node, image: &str, name: &str, layer: &str) -> bool {
    std::thread::scope(|s| {
        let run = s.spawn(|| node.run_out(image, name, &["busybox", "echo", "hi"]));
        let mut seen = false;
        while !run.is_finished() {
            // The task is listed first, the prefetch read after: a task listed before a
            // report that says "running" existed while the region was on the wire.
            let tasks = node.containerd.ctr(&["task", "ls", "-q"]);
            let listed = String::from_utf8_lossy(&tasks.stdout).lines().any(|l| l.trim() == name);
            let reports = node.layers_report();
            let running = reports.iter().any(|l| l["layer"] == layer && l["prefetch"] == "running");
            seen |= listed && running;
            std::thread::sleep(Duration::from_millis(50));
        }
        assert_eq!(run.join().unwrap(), "hi\n");
        seen
    })
}

#[test]
#[ignore = "needs root, containerd, runc, ctr-remote and the test registry: run by .ci/run"]
fn a_container_waits_for_its_layers_prefetch_and_the_pull_does_not() {
    // A slow link: every ranged read but the footer's is answered 3 s late.
    let proxy = FaultyRegistry::start(&registry());
    proxy.set(Fault::DelayRanges(Duration::from_secs(3)));
    let node = Node::start_with("background_fetch = false");
    let layers = node.layer_digests("busybox:esgz-prefetch");
    let image = format!("{}/strata/busybox:esgz-prefetch", proxy.addr);
    let out = node.containerd.ctr_remote(&["image", "rpull", "--plain-http", "--snapshotter", "strata", &image]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    // The pull returned with the prefetch still on the wire: it overlaps the rest of the pull.
    let reports = node.layers_report();
    let base = reports.iter().find(|l| l["layer"] == layers[0].as_str()).unwrap_or_else(|| panic!("{reports:#?}"));
    assert_eq!((&base["lazy"], &base["prefetch"]), (&true.into(), &"running".into()), "{base:#}");
    assert_eq!(prefetch_waits(&node).0, 0, "no container has started yet");

    // containerd and runc set the container up meanwhile; its first read of busybox, which
    // is not here yet, waits for the region, and the container then reads nothing more.
    assert!(
        task_seen_before_prefetch(&node, &image, "waited", &layers[0]),
        "the container's task was set up while the region was on the wire"
    );
    let (count, seconds) = prefetch_waits(&node);
    assert!(count >= 1 && seconds >= 1.0, "the container's read waited for the prefetch: {count} waits, {seconds} s");
    region_fetched_once(&node, &layers[0]);

    // With `prefetch_wait = "prepare"`, the container's Prepare waits for the region, so
    // containerd has no task for it until the region is in.
    let node = Node::start_with("background_fetch = false\nprefetch_wait = \"prepare\"");
    let out = node.containerd.ctr_remote(&["image", "rpull", "--plain-http", "--snapshotter", "strata", &image]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(!task_seen_before_prefetch(&node, &image, "prepared", &layers[0]), "no task before the region was in");
    let (count, seconds) = prefetch_waits(&node);
    assert!(
        count == 1 && seconds >= 1.0,
        "the container's Prepare waited for the prefetch: {count} waits, {seconds} s"
    );
    region_fetched_once(&node, &layers[0]);

    // With a shorter timeout than the link's delay, the container starts anyway, says so in the
    // log, and its reads wait for the prefetch in flight rather than fetching the bytes again.
    let node = Node::start_with("background_fetch = false\nprefetch_timeout = \"1s\"");
    let out = node.containerd.ctr_remote(&["image", "rpull", "--plain-http", "--snapshotter", "strata", &image]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let out = node.run_out(&image, "late", &["busybox", "echo", "hi"]);
    assert_eq!(out, "hi\n");
    let log = node.daemon.log();
    assert!(log.contains("prefetch not done in time; reads fetch on demand from now on"), "{log}");
    region_fetched_once(&node, &layers[0]);

    // A region over `prefetch_async_size` is not waited for at all (0: none is): the
    // container's Prepare goes on at once, and its reads wait for the region in flight instead
    // of fetching it again.
    let node = Node::start_with("background_fetch = false\nprefetch_async_size = \"0\"");
    let out = node.containerd.ctr_remote(&["image", "rpull", "--plain-http", "--snapshotter", "strata", &image]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let out = node.run_out(&image, "async", &["busybox", "echo", "hi"]);
    assert_eq!(out, "hi\n");
    assert_eq!(prefetch_waits(&node).0, 0, "no container waited for a region over the async size");
    let log = node.daemon.log();
    assert!(log.contains("prefetch region over prefetch_async_size; the container does not wait for it"), "{log}");
    region_fetched_once(&node, &layers[0]);
}

#[test]
#[ignore = "needs root, containerd, runc, ctr-remote and the test registry: run by .ci/run"]
fn a_registry_without_suffix_ranges_still_serves_lazy_layers() {
    // The footer is read with a suffix range, which names the blob's size too; a server that
    // answers it with the whole blob costs a HEAD and an ordinary range instead.
    let proxy = FaultyRegistry::start(&registry());
    proxy.set(Fault::NoSuffixRanges);
    let node = Node::start();
    let layers = node.layer_digests("busybox:esgz");
    let image = format!("{}/strata/busybox:esgz", proxy.addr);
    let mark = log_mark();
    let out = node.containerd.ctr_remote(&["image", "rpull", "--plain-http", "--snapshotter", "strata", &image]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    node.layer_when(&layers[0], |l| l["lazy"] == true);
    let out = node.run_out(&image, "no-suffix", &["busybox", "echo", "hi"]);
    assert_eq!(out, "hi\n");
    let log = registry_log();
    let heads = log[mark..].lines().filter(|l| l.contains(&format!("HEAD /v2/strata/busybox/blobs/{} ", layers[0])));
    assert!(heads.count() >= 1, "the size came from a HEAD:\n{}", &log[mark..]);
}

#[test]
#[ignore = "needs root, containerd, runc, ctr-remote and the test registry: run by .ci/run"]
fn after_a_restart_lazy_layers_mount_again_for_new_containers() {
    let mut node = Node::start();
    let image = node.rpull("busybox:esgz");
    node.ctr(&["run", "--rm", "--snapshotter", "strata", &image, "before", "true"]);
    node.daemon.kill9();
    node.daemon.spawn();
    // Containers starting together while the restarted daemon mounts its layers again in the
    // background: each layer is mounted once, not once per caller.
    node.containerd.wait_for_strata(Duration::from_secs(15));
    std::thread::scope(|s| {
        for n in 0..3 {
            let (containerd, image) = (&node.containerd, &image);
            s.spawn(move || {
                let name = format!("together-{n}");
                containerd.ctr(&["run", "--rm", "--snapshotter", "strata", image, &name, "true"])
            });
        }
    });
    assert_eq!(motd_after_restart(&node, common::containerd::NAMESPACE, &image), "strata layer two\n");
    let root = node.daemon.state().to_string_lossy().into_owned();
    let points: Vec<String> = std::fs::read_to_string("/proc/mounts")
        .unwrap()
        .lines()
        .filter(|l| l.starts_with("strata:"))
        .filter_map(|l| l.split(' ').nth(1).map(str::to_string))
        .filter(|p| p.starts_with(&root))
        .collect();
    assert!(!points.is_empty(), "the lazy layers are mounted again");
    let mut once = points.clone();
    once.sort();
    once.dedup();
    assert_eq!(once.len(), points.len(), "a layer mounted twice: {points:?}");
}

/// `/etc/motd` of a new container of `image` (in containerd namespace `namespace`), once the
/// restarted daemon serves the layers again (at most 30 s). The output comes through a file, as
/// in [`Containerd::run_captured`].
fn motd_after_restart(node: &Node, namespace: &str, image: &str) -> String {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    // runc's state is shared by the tests' containerds, so names differ.
    let name = format!("after-restart-{namespace}");
    let out_dir = tempfile::tempdir().unwrap();
    let bind = format!("type=bind,src={},dst=/strata-out,options=rbind:rw", out_dir.path().display());
    loop {
        let out = std::process::Command::new("ctr")
            .arg("--address")
            .arg(&node.containerd.address)
            .args(["-n", namespace, "run", "--rm", "--snapshotter", "strata", "--mount", &bind, image, &name])
            .args(["sh", "-c", "cat /etc/motd > /strata-out/stdout"])
            .output()
            .unwrap();
        if out.status.success() {
            return std::fs::read_to_string(out_dir.path().join("stdout")).unwrap();
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no container after the restart: {}\n{}",
            String::from_utf8_lossy(&out.stderr),
            node.daemon.log()
        );
        std::thread::sleep(Duration::from_millis(500));
    }
}

#[test]
#[ignore = "needs root, containerd, runc, ctr-remote and the test registry: run by .ci/run"]
fn a_layer_whose_toc_does_not_match_is_fetched_whole_and_named() {
    // specials:bad-toc mixes two lazy layers with one that cannot be lazy.
    let node = Node::start();
    let mark = log_mark();
    let image = node.rpull("specials:bad-toc");
    let layers = node.layer_digests("specials:bad-toc");
    let log = node.daemon.log();
    let line = log.lines().find(|l| l.contains("layer fetched whole and unpacked") && l.contains(&layers[2]));
    let line = line.unwrap_or_else(|| panic!("the log names the layer:\n{log}"));
    assert!(line.contains("TOC's digest"), "and says why: {line}");
    let metrics = node.daemon.metrics_text();
    assert!(metrics.contains("strata_snapshotter_layers_total{how=\"lazy\"} 2"), "{metrics}");
    assert!(metrics.contains("strata_snapshotter_layers_total{how=\"whole\"} 1"), "{metrics}");
    // Strata fetched the refused layer itself, checked; containerd fetched no layer at all.
    let log = registry_log();
    let gets = |agent: &str, d: &str| {
        log[mark..]
            .lines()
            .filter(|l| {
                l.contains("\"GET ")
                    && l.contains(&format!("/blobs/{d} "))
                    && l.contains("\" 200 ")
                    && l.contains(agent)
            })
            .count()
    };
    assert_eq!(gets("strata/", &layers[2]), 1);
    for d in &layers {
        assert_eq!(gets("containerd/", d), 0, "containerd fetched {d}");
    }
    let report = node.layers_report();
    let whole = report.iter().find(|l| l["layer"] == layers[2].as_str()).unwrap();
    assert_eq!((whole["how"].as_str(), whole["lazy"].as_bool()), (Some("whole"), Some(false)), "{whole:#}");
    let out = node.run_sh(
        &image,
        "bad-toc",
        "cat /opt/file /opt/hard /etc/motd; stat -c '%a %u:%g %t,%T' /opt/suid /opt/owned /opt/char",
    );
    assert_eq!(
        out, "linked content\nlinked content\nstrata layer two\n4755 0:0 0,0\n640 1000:1000 0,0\n644 0:0 1,3\n",
        "lazy layers and the layer Strata unpacked stack and run, modes, owners and devices kept"
    );
}

#[tokio::test]
#[ignore = "needs root, containerd, runc and the test registry: run by .ci/run"]
async fn a_pull_through_cri_is_lazy_too() {
    use strata_snapshotter::proto::cri::{ImageSpec, PullImageRequest, image_service_client::ImageServiceClient};
    let node = Node::start_cri();
    let mark = log_mark();
    let image = format!("{}/strata/busybox:esgz", registry());
    // As kubelet does it: the CRI image service on containerd's socket.
    let channel = strata_snapshotter::server::channel(&node.containerd.address).await.unwrap();
    let request =
        PullImageRequest { image: Some(ImageSpec { image: image.clone(), ..Default::default() }), auth: None };
    let pulled = ImageServiceClient::new(channel).pull_image(request).await;
    let pulled =
        pulled.unwrap_or_else(|e| panic!("CRI PullImage: {e}\n{}\n{}", node.containerd.log(), node.daemon.log()));
    assert!(pulled.into_inner().image_ref.starts_with("sha256:"));
    let metrics = node.daemon.metrics_text();
    assert!(metrics.contains("strata_snapshotter_layers_total{how=\"lazy\"} 2"), "{metrics}");
    for d in &node.layer_digests("busybox:esgz") {
        assert_eq!(whole_downloads(mark, d), 0, "containerd downloaded layer {d}");
        node.layer_when(d, |l| l["lazy"] == true);
    }
    // The image's config, for the program it runs, is read from the manifest containerd pulled,
    // whose digest the CRI passes, not from whatever the tag names by then.
    let by_digest = || {
        registry_log()[mark..]
            .lines()
            .filter(|l| l.contains("\"GET /v2/strata/busybox/manifests/sha256:") && l.contains("\"strata/"))
            .count()
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while by_digest() == 0 && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(by_digest(), 1, "one manifest read by Strata, by digest, for both layers");
}

#[tokio::test]
#[ignore = "needs root, containerd, docker-registry, htpasswd and the test registry: run by .ci/run"]
async fn a_pull_secret_kubelet_passes_through_the_image_service_makes_the_pull_lazy() {
    use strata_snapshotter::proto::cri::image_service_client::ImageServiceClient;
    use strata_snapshotter::proto::cri::{AuthConfig, ImageSpec, ImageStatusRequest, PullImageRequest};
    // A registry that turns anonymous readers away, and no login on the node: the only one is
    // the pod's pull secret, which kubelet sends with the CRI pull, to Strata's image service.
    let reg = AuthRegistry::start(Auth::Basic);
    let mut node = Node::start_cri_with_image_service();
    let image = format!("{}/strata/busybox:esgz", reg.addr);
    let spec = ImageSpec { image: image.clone(), ..Default::default() };
    let channel = strata_snapshotter::server::channel(&node.image_service()).await.unwrap();
    let mut images = ImageServiceClient::new(channel);
    let auth = AuthConfig { username: USER.into(), password: PASSWORD.into(), ..Default::default() };
    let pulled = images.pull_image(PullImageRequest { image: Some(spec.clone()), auth: Some(auth) }).await;
    let pulled = pulled
        .unwrap_or_else(|e| panic!("CRI PullImage: {e}\n{}\n{}", node.containerd.log(), node.daemon.log()))
        .into_inner();
    assert!(pulled.image_ref.starts_with("sha256:"), "{pulled:?}");
    // Without the login Strata would answer a 401, and containerd would download the layers.
    for d in &node.layer_digests("busybox:esgz") {
        let l = node.layer_when(d, |l| l["image"] == image.as_str());
        assert_eq!((&l["lazy"], &l["how"]), (&true.into(), &"lazy".into()), "{l:#}");
    }
    assert_eq!(metric(&node, "strata_snapshotter_cri_pulls_total{login=\"kept\"}"), 1);
    // Every other call goes on to containerd as it came: the image pulled is there.
    let status = images.image_status(ImageStatusRequest { image: Some(spec) }).await.unwrap().into_inner();
    let found = status.image.unwrap_or_else(|| panic!("ImageStatus found no image"));
    assert_eq!(found.id, pulled.image_ref);
    assert!(found.repo_tags.contains(&image), "{found:?}");
    // The rest of each layer comes in the background, with the same login.
    for d in &node.layer_digests("busybox:esgz") {
        let l = node.layer_when(d, |l| l["background"] == "done");
        assert_eq!(l["chunks_cached"], l["chunks_total"], "{l:#}");
        assert!(l["error"].is_null(), "{l:#}");
    }

    // A pod with a wrong secret fails its pull, and its login does not replace the one that
    // works.
    let wrong = AuthConfig { username: USER.into(), password: "not-the-password".into(), ..Default::default() };
    let spec = ImageSpec { image: image.clone(), ..Default::default() };
    let failed = images.pull_image(PullImageRequest { image: Some(spec), auth: Some(wrong) }).await;
    assert!(failed.is_err(), "a pull with a wrong password fails");
    assert_eq!(metric(&node, "strata_snapshotter_cri_pulls_total{login=\"failed\"}"), 1);

    // After a restart the layers are mounted again, and read, with the login kept on disk:
    // kubelet does not pull an image it has again.
    node.daemon.kill9();
    node.daemon.spawn();
    assert_eq!(motd_after_restart(&node, "k8s.io", &image), "strata layer two\n");
    let log = node.daemon.log();
    assert!(!log.contains("not mounted at start-up"), "{log}");
    for d in &node.layer_digests("busybox:esgz") {
        let l = node.layer_when(d, |l| l["image"] == image.as_str());
        assert_eq!(l["lazy"], true, "{l:#}");
    }
}

#[test]
#[ignore = "needs root, containerd, runc, ctr-remote and the test registry: run by .ci/run"]
fn the_start_up_files_are_asked_for_while_the_toc_is_still_arriving() {
    // ctr-remote's optimized image says nothing in its descriptor of where its TOC or its
    // prefetch region are: both come from the TOC, whose landmark entry is near its start. The
    // first read of the layer's end, which holds the whole TOC, stalls half-way, with the TOC's
    // start in its first half; the region's request must not wait for the rest of it.
    let node = Node::start_with("background_fetch = false");
    let proxy = FaultyRegistry::start(&registry());
    proxy.set(Fault::StallMidway(Duration::from_secs(2)));
    let image = format!("{}/strata/python:esgz-opt", proxy.addr);
    let out = node.containerd.ctr_remote(&["image", "rpull", "--plain-http", "--snapshotter", "strata", &image]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let layers = node.layer_digests("python:esgz-opt");
    let layer = node.layer_when(&layers[0], |l| l["prefetch"] == "done");
    let region = layer["prefetch_bytes"].as_u64().unwrap();
    // In the order the answers ended: the region's (bytes 0 to the landmark), which alone is
    // not stalled, the first read of the layer's end (512 KiB, with the footer and the TOC), and
    // `/etc/passwd` and `/etc/group`.
    let answers = proxy.blob_answers(0, &layers[0]);
    let region_at = answers.iter().position(|n| *n == region).unwrap_or_else(|| panic!("{region}: {answers:?}"));
    let toc_at = answers.iter().position(|n| *n == 512 << 10).unwrap_or_else(|| panic!("{answers:?}"));
    assert!(region_at < toc_at, "the region came after the whole TOC: {answers:?}");
    let out = node.ctr(&["run", "--rm", "--snapshotter", "strata", &image, "stalled", "python3", "-c", "print(1)"]);
    assert_eq!(out, "1\n");
}

/// The proxy's mark once a second has passed without a blob answer: what the node fetches of
/// its own accord after a pull is in by then.
fn quiet(proxy: &FaultyRegistry) -> usize {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let mut seen = proxy.mark();
    loop {
        std::thread::sleep(std::time::Duration::from_secs(1));
        let now = proxy.mark();
        if now == seen {
            return now;
        }
        assert!(std::time::Instant::now() < deadline, "the node kept fetching: {now} answers");
        seen = now;
    }
}

/// `strata_snapshotter_loader_files_fetched_ahead_total`: files fetched for starting programs'
/// loaders before they asked.
fn loader_files_ahead(node: &Node) -> u64 {
    metric(node, "strata_snapshotter_loader_files_fetched_ahead_total")
}

/// A counter's value on the node's metrics endpoint (0 before it is first counted).
fn metric(node: &Node, name: &str) -> u64 {
    let metrics = node.daemon.metrics_text();
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse::<u64>().ok())
        .unwrap_or(0)
}

#[test]
#[ignore = "needs root, containerd, runc, ctr-remote and the test registry: run by .ci/run"]
fn a_program_over_a_base_layer_pulled_with_another_image_has_its_libraries_fetched_from_it() {
    // python:app-esgz is python:esgz's layer and one with /usr/local/bin/app (python3.11 by
    // another name), whose interpreter and libraries are all in the layer under it. The image's
    // own program (python3) is not fetched ahead here, so that only the started one counts.
    let node = Node::start_with("background_fetch = false\nfetch_image_program = false");
    let (base, app) = (node.layer_digests("python:esgz"), node.layer_digests("python:app-esgz"));
    assert_eq!(app.len(), 2);
    assert_eq!(app[0], base[0], "the two images share their base layer");
    // The base layer is mounted for the first image; nothing of it is read.
    node.rpull("python:esgz");
    let image = node.rpull("python:app-esgz");
    assert_eq!(loader_files_ahead(&node), 0, "no program has started yet");
    let out =
        node.ctr(&["run", "--rm", "--snapshotter", "strata", &image, "app", "/usr/local/bin/app", "-c", "print(1)"]);
    assert_eq!(out, "1\n");
    // The base layer was mounted for another image, so only the snapshot chain says it is
    // under the program's layer.
    let ahead = loader_files_ahead(&node);
    assert!(ahead >= 4, "the interpreter, its cache, libm and libc, from the base layer: {ahead}");
}

#[test]
#[ignore = "needs root, containerd, runc, ctr-remote and the test registry: run by .ci/run"]
fn an_images_own_program_and_its_libraries_are_fetched_as_its_layer_is_mounted() {
    // python:esgz has no prefetch region, and its config runs /usr/bin/python3.
    for fetch_program in [true, false] {
        let node = Node::start_with(&format!("background_fetch = false\nfetch_image_program = {fetch_program}"));
        let layer = node.layer_digests("python:esgz")[0].clone();
        let image = node.rpull("python:esgz");
        // No container has run: what is fetched, the image's program brought.
        let fetched = |l: &serde_json::Value| l["fetched_bytes"].as_u64().unwrap_or(0);
        if fetch_program {
            let l = node.layer_when(&layer, |l| fetched(l) > 2 << 20 && loader_files_ahead(&node) >= 5);
            eprintln!("before any container: {} bytes fetched, {} files", fetched(&l), loader_files_ahead(&node));
            // python3.11's chunks were asked for while the TOC was parsed, and those requests'
            // answers were what its fetches took.
            let early = metric(&node, "strata_snapshotter_chunks_asked_before_toc_parsed_total");
            assert!(early >= 1, "chunks fetched by a request made before the TOC was parsed: {early}");
        } else {
            std::thread::sleep(std::time::Duration::from_secs(3));
            let l = node.layer_when(&layer, |_| true);
            // Only /etc/passwd and /etc/group, which every layer without a region has fetched.
            assert!(fetched(&l) < 64 << 10, "nothing else is fetched when it is turned off: {l:#}");
            assert_eq!(loader_files_ahead(&node), 0);
        }
        let out = node.ctr(&["run", "--rm", "--snapshotter", "strata", &image, "python", "python3", "-c", "print(1)"]);
        assert_eq!(out, "1\n");
        if !fetch_program {
            // Started by the container instead, python was followed from its own first read:
            // its loader's files, and what the C library and its start read.
            let ahead = loader_files_ahead(&node);
            assert!(ahead >= 14, "files fetched ahead once python started: {ahead}");
        }
    }
}

#[test]
#[ignore = "needs root, containerd, runc, ctr-remote and the test registry: run by .ci/run"]
fn python_starts_having_fetched_a_small_part_of_its_image() {
    // The image as `ctr-remote image convert` wrote it, and as `ctr-remote image optimize` did,
    // with the files python3 read at start-up before its .prefetch.landmark.
    for reference in ["python:esgz", "python:esgz-opt"] {
        // Without background fill, what is fetched is what start-up reads (and the TOC). A
        // node each: chunks are shared by digest, so a second pull would find them cached.
        // Through a proxy of this test's own, which counts what this node fetched: other tests
        // may pull the same image from the registry meanwhile.
        let node = Node::start_with("background_fetch = false");
        let proxy = FaultyRegistry::start(&registry());
        let image = format!("{}/strata/{reference}", proxy.addr);
        let out = node.containerd.ctr_remote(&["image", "rpull", "--plain-http", "--snapshotter", "strata", &image]);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let layers = node.layer_digests(reference);
        // The optimized image's prefetch region, with the user and group files runc reads at
        // every start (which its recording left out) fetched beside it, is all python's start
        // needs: once they are in, the container fetches nothing of its own. So is, for the
        // plain image, what was fetched ahead for its program once its layer was mounted.
        if reference.ends_with("-opt") {
            node.layer_when(&layers[0], |l| l["prefetch"] == "done");
        }
        let started = quiet(&proxy);
        if !reference.ends_with("-opt") {
            // Without a region, the image's program was fetched at the mount, with what its
            // loader, the C library and the interpreter's start read: the interpreter, its
            // cache, four libraries, the locale, the charset cache, nsswitch.conf and python's
            // encodings and sitecustomize, at least.
            let ahead = loader_files_ahead(&node);
            assert!(ahead >= 14, "files fetched ahead: {ahead}");
        }
        let out = node.ctr(&["run", "--rm", "--snapshotter", "strata", &image, "python", "python3", "-c", "print(1)"]);
        assert_eq!(out, "1\n");
        let answers = proxy.blob_answers(started, &layers[0]);
        assert!(answers.is_empty(), "{reference}: the container's own fetches: {answers:?}");
        let (tag_repo, tag) = reference.split_once(':').unwrap();
        let url = format!("http://{}/v2/strata/{tag_repo}/manifests/{tag}", registry());
        let manifest = std::process::Command::new("curl")
            .args(["-fsS", "-H", "Accept: application/vnd.oci.image.manifest.v1+json", &url])
            .output()
            .unwrap();
        let m: serde_json::Value = serde_json::from_slice(&manifest.stdout).unwrap();
        let (mut total, mut fetched) = (0u64, 0u64);
        for l in m["layers"].as_array().unwrap() {
            total += l["size"].as_u64().unwrap();
            fetched += proxy.blob_answers(0, l["digest"].as_str().unwrap()).iter().sum::<u64>();
        }
        let share = fetched as f64 / total as f64;
        eprintln!(
            "{reference}: python3 -c 'print(1)': {fetched} of {total} compressed bytes fetched before its output ({:.1}%)",
            share * 100.0
        );
        assert!(fetched > 0, "the proxy saw the reads");
        assert!(
            share < 0.20,
            "{reference}: {fetched} of {total} bytes ({:.1}%) before the first output",
            share * 100.0
        );
        if reference.ends_with("-opt") {
            let layer = m["layers"][0]["digest"].as_str().unwrap();
            let l = node.layer_when(layer, |l| l["prefetch"] == "done");
            assert!(l["prefetch_bytes"].as_u64().unwrap() > 1 << 20, "optimize put python3's files first: {l:#}");
        }
    }
}

#[test]
#[ignore = "needs root, containerd, runc, ctr-remote and the test registry: run by .ci/run"]
fn a_registry_that_fails_or_flips_bytes_gives_clear_errors_and_never_wrong_bytes() {
    let proxy = FaultyRegistry::start(&registry());
    // Without background fill, and without the image's program fetched at its mount, the
    // container's own reads are what fetch the chunks.
    let node = Node::start_with("background_fetch = false\nfetch_image_program = false");
    let layers = node.layer_digests("busybox:esgz");
    let image = format!("{}/strata/busybox:esgz", proxy.addr);
    let rpull =
        |image: &str| node.containerd.ctr_remote(&["image", "rpull", "--plain-http", "--snapshotter", "strata", image]);

    // The registry goes away once the manifest and config are fetched: the pull fails, and
    // says which layer; nothing half-made is left to trip the retry.
    proxy.set(Fault::Refuse(layers.clone()));
    let out = rpull(&image);
    assert!(!out.status.success(), "the pull cannot succeed without the layers");
    let log = node.daemon.log();
    assert!(
        log.contains("fetching it whole failed") && log.contains(&layers[0]),
        "Strata says which layer and why:\n{log}"
    );
    proxy.set(Fault::None);
    let out = rpull(&image);
    assert!(out.status.success(), "a retry works: {}", String::from_utf8_lossy(&out.stderr));

    // The registry now flips a byte in every range it serves: the read that needs such a chunk
    // fails with EIO, the chunk is counted, and nothing of it is cached.
    proxy.set(Fault::FlipRanges);
    let bad =
        node.containerd.ctr(&["run", "--rm", "--snapshotter", "strata", &image, "flipped", "busybox", "echo", "hi"]);
    assert!(!bad.status.success(), "a container cannot start on bytes that fail their digest");
    let metrics = node.daemon.metrics_text();
    let rejected = metrics
        .lines()
        .find_map(|l| l.strip_prefix("strata_snapshotter_chunks_rejected_total "))
        .and_then(|v| v.trim().parse::<u64>().ok())
        .unwrap_or(0);
    assert!(rejected >= 1, "the rejected chunk is counted:\n{metrics}");
    proxy.set(Fault::None);
    let out = node.run_out(&image, "healthy", &["busybox", "echo", "hi"]);
    assert_eq!(out, "hi\n", "with the registry honest again, the same image runs");
}

#[test]
#[ignore = "needs root, containerd, runc, ctr-remote and the test registry: run by .ci/run"]
fn a_truncated_blob_is_a_clear_error_and_a_retry_works() {
    let proxy = FaultyRegistry::start(&registry());
    let node = Node::start();
    let layers = node.layer_digests("busybox:esgz-64k");
    let image = format!("{}/strata/busybox:esgz-64k", proxy.addr);
    let rpull =
        |image: &str| node.containerd.ctr_remote(&["image", "rpull", "--plain-http", "--snapshotter", "strata", image]);

    // Every answer for a layer blob ends half-way: neither the footer and TOC nor the whole
    // blob can be had, and the pull fails saying which layer and that its bytes ended early.
    proxy.set(Fault::Truncate(layers.clone()));
    let out = rpull(&image);
    assert!(!out.status.success(), "a pull of truncated blobs cannot succeed");
    let log = node.daemon.log();
    let line = log.lines().find(|l| l.contains(&layers[0]) && l.contains("fetching it whole failed"));
    let line = line.unwrap_or_else(|| panic!("Strata names the layer:\n{log}"));
    assert!(line.contains("ended early") || line.contains("short"), "and says its bytes ended early: {line}");
    let report = node.layers_report();
    let l = report.iter().find(|l| l["layer"] == layers[0].as_str()).unwrap_or_else(|| panic!("{report:#?}"));
    assert_eq!((&l["lazy"], &l["how"]), (&false.into(), &"containerd".into()), "not mounted on part of a blob: {l:#}");
    assert!(l["reason"].as_str().unwrap().contains("ended early"), "{l:#}");

    proxy.set(Fault::None);
    let out = rpull(&image);
    assert!(out.status.success(), "a retry works: {}", String::from_utf8_lossy(&out.stderr));
    node.layer_when(&layers[0], |l| l["lazy"] == true);
    let out = node.run_out(&image, "whole-again", &["cat", "/etc/motd"]);
    assert_eq!(out, "strata layer two\n");
}

#[test]
#[ignore = "needs root, containerd, runc, ctr-remote and the test registry: run by .ci/run"]
fn a_toc_over_the_limit_is_refused_and_the_layer_fetched_whole() {
    // The python image's TOC is about 2.5 MB of JSON.
    let node = Node::start_with("max_toc_size = \"1MiB\"");
    let image = node.rpull("python:esgz");
    let layers = node.layer_digests("python:esgz");
    let log = node.daemon.log();
    let line = log.lines().find(|l| l.contains("layer fetched whole and unpacked") && l.contains(&layers[0]));
    let line = line.unwrap_or_else(|| panic!("the log names the layer:\n{log}"));
    assert!(line.contains("over the limit of 1048576 bytes"), "and says why: {line}");
    let metrics = node.daemon.metrics_text();
    assert!(metrics.contains("strata_snapshotter_layers_total{how=\"whole\"} 1"), "{metrics}");
    let out =
        node.ctr(&["run", "--rm", "--snapshotter", "strata", &image, "python-whole", "python3", "-c", "print(1)"]);
    assert_eq!(out, "1\n");
}

/// `reference`'s chain ID: the name its top layer is committed under (containerd's identity
/// of a layer stack: sha256 of "parent-chain diff-id", from the config's diff_ids).
fn chain_id(reference: &str) -> String {
    let (repo, tag) = reference.split_once(':').unwrap();
    let get = |path: String, accept: &str| {
        let out = std::process::Command::new("curl")
            .args(["-fsS", "-H", &format!("Accept: {accept}")])
            .arg(format!("http://{}/v2/strata/{repo}/{path}", registry()))
            .output()
            .unwrap();
        assert!(out.status.success(), "{path}: {}", String::from_utf8_lossy(&out.stderr));
        serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()
    };
    let manifest = get(format!("manifests/{tag}"), "application/vnd.oci.image.manifest.v1+json");
    let config = get(format!("blobs/{}", manifest["config"]["digest"].as_str().unwrap()), "*/*");
    let mut chain = String::new();
    for diff in config["rootfs"]["diff_ids"].as_array().unwrap() {
        let diff = diff.as_str().unwrap();
        chain = if chain.is_empty() {
            diff.to_string()
        } else {
            format!("sha256:{}", sha(format!("{chain} {diff}").as_bytes()))
        };
    }
    chain
}

/// `umoci unpack` of `reference`, copied from the registry by skopeo, into `dir/bundle`.
fn umoci_unpack(reference: &str, dir: &Path) -> PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    let layout = format!("{}:img", dir.join("oci").display());
    let run = |cmd: &str, args: &[&str]| {
        let out = std::process::Command::new(cmd).args(args).output().unwrap();
        assert!(out.status.success(), "{cmd} {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    };
    let src = format!("docker://{}/strata/{reference}", registry());
    run("skopeo", &["copy", "-q", "--src-tls-verify=false", &src, &format!("oci:{layout}")]);
    let bundle = dir.join("bundle");
    run("umoci", &["unpack", "--image", &layout, bundle.to_str().unwrap()]);
    bundle.join("rootfs")
}

#[test]
#[ignore = "needs root, containerd, skopeo, umoci and the test registry: run by .ci/run"]
fn lazily_mounted_images_hold_what_umoci_unpacks() {
    let node = Node::start();
    let work = tempfile::tempdir().unwrap();
    // specials: hard links, a device, a fifo, setuid, an xattr, another owner, a whiteout;
    // python: an image `ctr-remote image optimize` wrote, with its prefetch landmark.
    for reference in ["specials:esgz", "python:esgz-opt"] {
        node.rpull(reference);
        for d in &node.layer_digests(reference) {
            node.layer_when(d, |l| l["lazy"] == true);
        }
        // A read-only view of the image, mounted here as containerd would mount it.
        let view = format!("view-{}", reference.replace(':', "-"));
        let mounts =
            node.ctr(&["snapshots", "--snapshotter", "strata", "view", "--mounts", &view, &chain_id(reference)]);
        let mounts: Vec<serde_json::Value> = serde_json::from_str(&mounts).unwrap();
        let target = work.path().join(&view);
        std::fs::create_dir_all(&target).unwrap();
        // containerd's mount type, printed with Go's field names.
        let m = &mounts[0];
        let options: Vec<&str> = m["Options"].as_array().unwrap().iter().map(|o| o.as_str().unwrap()).collect();
        let out = std::process::Command::new("mount")
            .args(["-t", m["Type"].as_str().unwrap(), "-o", &options.join(",")])
            .arg(m["Source"].as_str().unwrap())
            .arg(&target)
            .output()
            .unwrap();
        assert!(out.status.success(), "mount {m}: {}", String::from_utf8_lossy(&out.stderr));
        let _unmount = Unmount(target.clone());

        let unpacked = umoci_unpack(reference, &work.path().join(reference.replace(':', "-")));
        let (mut lazy, lazy_links) = common::tree::tree(&target);
        let (mut plain, plain_links) = common::tree::tree(&unpacked);
        // The eStargz format's own files are not the image's; Strata hides them, as
        // stargz-snapshotter does, while a plain unpack writes them out.
        for meta in ["stargz.index.json", ".prefetch.landmark", ".no.prefetch.landmark"] {
            plain.remove(meta);
        }
        // A layer whose tar leaves out a parent directory (umoci's diffs leave out the ones
        // they did not change) gives no time for it, and overlayfs shows the upper layer's
        // copy: Strata's has time 0, containerd's own unpack the time of unpacking. Every
        // directory the layers do list is compared in full.
        for (path, e) in lazy.iter_mut().filter(|(_, e)| e.kind == "dir" && e.mtime == 0) {
            if let Some(p) = plain.get_mut(path) {
                p.mtime = e.mtime;
            }
        }
        let diff = common::tree::differences(&lazy, &plain, 20);
        assert!(
            diff.is_empty(),
            "{reference}: lazy mount (first) and umoci unpack (second) differ:\n{}",
            diff.join("\n")
        );
        assert_eq!(lazy_links, plain_links, "{reference}: hard links");
        assert!(lazy.len() > 10, "{reference}: {} entries compared", lazy.len());
        eprintln!(
            "{reference}: {} entries and {} hard-link groups equal to umoci unpack",
            lazy.len(),
            lazy_links.len()
        );
    }
}

/// Unmounts on drop, so a failed assertion leaves no mount behind.
struct Unmount(PathBuf);

impl Drop for Unmount {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount").arg(&self.0).status();
    }
}

/// Pulls busybox:esgz from `host` lazily, with ctr-remote's `extra` flags (its own login, a
/// hosts dir), and checks that both layers are lazy mounts and a container runs on them.
fn pull_lazily_from(node: &Node, host: &str, extra: &[&str]) -> Vec<String> {
    let image = format!("{host}/strata/busybox:esgz");
    let mut args = vec!["image", "rpull", "--snapshotter", "strata"];
    args.extend_from_slice(extra);
    args.push(&image);
    let out = node.containerd.ctr_remote(&args);
    assert!(out.status.success(), "rpull {image}: {}\n{}", String::from_utf8_lossy(&out.stderr), node.daemon.log());
    let layers = node.layer_digests("busybox:esgz");
    for d in &layers {
        let l = node.layer_when(d, |l| l["image"] == image.as_str());
        assert_eq!(l["lazy"], true, "{l:#}");
    }
    // runc's state is shared by the tests' containerds, so names differ.
    let name = format!("from-{}", host.replace([':', '.'], "-"));
    let out = node.run_out(&image, &name, &["cat", "/etc/motd"]);
    assert_eq!(out, "strata layer two\n");
    layers
}

#[test]
#[ignore = "needs root, containerd, docker-registry, htpasswd and the test registry: run by .ci/run"]
fn a_registry_behind_basic_auth_is_read_with_the_docker_login() {
    let reg = AuthRegistry::start(Auth::Basic);
    let login = format!("{USER}:{PASSWORD}");
    // The login from config.json: lazy, from a registry that turns anonymous readers away.
    let config = reg.docker_config(PASSWORD);
    let node = Node::start_with(&format!("docker_config = \"{}\"", config.display()));
    pull_lazily_from(&node, &reg.addr, &["--plain-http", "--user", &login]);
    drop(node);

    // A wrong password: Strata cannot read the layers and says why; containerd, which has the
    // right login, fetches them itself, and the container still runs.
    let config = reg.docker_config("not-the-password");
    let node = Node::start_with(&format!("docker_config = \"{}\"", config.display()));
    let image = format!("{}/strata/busybox:esgz", reg.addr);
    let out = node.containerd.ctr_remote(&[
        "image",
        "rpull",
        "--plain-http",
        "--snapshotter",
        "strata",
        "--user",
        &login,
        &image,
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let layer = &node.layer_digests("busybox:esgz")[0];
    let l = node.layer_when(layer, |l| l["image"] == image.as_str());
    assert_eq!((&l["lazy"], &l["how"]), (&false.into(), &"containerd".into()), "{l:#}");
    let reason = l["reason"].as_str().unwrap();
    assert!(reason.contains("401"), "the reason names the refusal: {reason}");
    let out = node.run_out(&image, "fallback", &["cat", "/etc/motd"]);
    assert_eq!(out, "strata layer two\n");
}

/// A node whose config.json names a credential helper for the registry and holds no login, as
/// `docker login` through ECR's or gcloud's helper leaves it: Strata asks the helper.
#[test]
#[ignore = "needs root, containerd, docker-registry, htpasswd and the test registry: run by .ci/run"]
fn a_registry_behind_basic_auth_is_read_with_the_login_of_a_credential_helper() {
    let reg = AuthRegistry::start(Auth::Basic);
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("config.json");
    std::fs::write(&config, format!(r#"{{"credHelpers": {{"{}": "strata-test"}}}}"#, reg.addr)).unwrap();
    let node = Node::start_with(&format!("docker_config = \"{}\"", config.display()));
    // The helper has a login for this registry only, and keeps a list of what it was asked.
    let asked = dir.path().join("asked");
    std::fs::create_dir_all(node.daemon.bin_dir()).unwrap();
    let helper = node.daemon.bin_dir().join("docker-credential-strata-test");
    std::fs::write(
        &helper,
        format!(
            "#!/bin/sh\n[ \"$1\" = get ] || exit 2\nread -r server\necho \"$server\" >> {asked}\n\
             if [ \"$server\" = {addr} ]; then\n  echo '{{\"ServerURL\":\"{addr}\",\"Username\":\"{USER}\",\"Secret\":\"{PASSWORD}\"}}'\n\
             else\n  echo 'credentials not found in native keychain'; exit 1\nfi\n",
            asked = asked.display(),
            addr = reg.addr,
        ),
    )
    .unwrap();
    std::fs::set_permissions(&helper, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    pull_lazily_from(&node, &reg.addr, &["--plain-http", "--user", &format!("{USER}:{PASSWORD}")]);
    // Once, for the pull's two layers and their reads together.
    let asked = std::fs::read_to_string(&asked).unwrap_or_default();
    assert_eq!(asked, format!("{}\n", reg.addr), "the helper was asked for the registry, once");
}

#[test]
#[ignore = "needs root, containerd, docker-registry, openssl and the test registry: run by .ci/run"]
fn a_registry_with_token_auth_is_read_with_a_bearer_token() {
    let reg = AuthRegistry::start(Auth::Token);
    let config = reg.docker_config(PASSWORD);
    // Strata asked the token server itself, with the login, for pull access to the repository.
    for r in tokens_strata_asked_for(&reg, &config) {
        assert!(r.login_ok, "with the login from config.json: {r:?}");
    }
}

/// Pulls lazily from `reg` (token auth) with Strata's logins in `config`, and gives the requests
/// Strata made of the token server, each checked to ask for pull access to the repository.
fn tokens_strata_asked_for(reg: &AuthRegistry, config: &Path) -> Vec<common::auth_registry::TokenRequest> {
    let node = Node::start_with(&format!("docker_config = \"{}\"", config.display()));
    pull_lazily_from(&node, &reg.addr, &["--plain-http", "--user", &format!("{USER}:{PASSWORD}")]);
    let asked = reg.token_requests.lock().unwrap().clone();
    let ours: Vec<_> = asked.iter().filter(|r| r.user_agent.starts_with("strata/")).cloned().collect();
    assert!(!ours.is_empty(), "Strata asked for a token: {asked:#?}");
    for r in &ours {
        assert!(
            r.line.contains("repository%3Astrata%2Fbusybox%3Apull")
                || r.line.contains("repository:strata/busybox:pull"),
            "{r:?}"
        );
    }
    ours
}

/// config.json's login is an identity token (an OAuth2 refresh token, as `az acr login`
/// writes): Strata exchanges it at the token server through the OAuth2 form, as containerd does.
#[test]
#[ignore = "needs root, containerd, docker-registry, openssl and the test registry: run by .ci/run"]
fn a_registry_with_token_auth_is_read_with_an_identity_token() {
    let reg = AuthRegistry::start(Auth::Token);
    let config = reg.docker_config_identity_token();
    for r in tokens_strata_asked_for(&reg, &config) {
        assert!(r.line.starts_with("POST ") && r.login_ok, "the identity token, through the form: {r:?}");
    }
}

#[test]
#[ignore = "needs root, containerd and the test registry: run by .ci/run"]
fn a_hosts_toml_mirror_serves_a_registry_that_is_down() {
    // The image's own registry is a port nothing listens on; hosts.toml sends reads to a
    // mirror (the test registry), as containerd's config_path does.
    let dead = common::free_port();
    let hosts = tempfile::tempdir().unwrap();
    let dir = hosts.path().join(format!("127.0.0.1:{dead}"));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("hosts.toml"),
        format!(
            "server = \"http://127.0.0.1:{dead}\"\n[host.\"http://{}\"]\n  capabilities = [\"pull\", \"resolve\"]\n",
            registry()
        ),
    )
    .unwrap();
    let node = Node::start_with(&format!("hosts_dir = \"{}\"", hosts.path().display()));
    let mark = log_mark();
    let layers = pull_lazily_from(
        &node,
        &format!("127.0.0.1:{dead}"),
        &["--plain-http", "--hosts-dir", hosts.path().to_str().unwrap()],
    );
    // Strata's ranged reads went to the mirror.
    let ranged = registry_log()[mark..]
        .lines()
        .filter(|l| l.contains("\" 206 ") && l.contains("strata/") && layers.iter().any(|d| l.contains(d.as_str())))
        .count();
    assert!(ranged > 0, "the mirror served Strata's ranged reads");
}

/// A mirror behind a login of its own: Strata reads through it with the login config.json has
/// for the mirror's host, as containerd does, though config.json has none for the image's own
/// registry (here a port nothing listens on).
#[test]
#[ignore = "needs root, containerd, docker-registry, htpasswd and the test registry: run by .ci/run"]
fn a_mirror_is_read_with_its_own_login() {
    let reg = AuthRegistry::start(Auth::Basic);
    let dead = common::free_port();
    let hosts = tempfile::tempdir().unwrap();
    let dir = hosts.path().join(format!("127.0.0.1:{dead}"));
    std::fs::create_dir_all(&dir).unwrap();
    let toml = format!(
        "server = \"http://127.0.0.1:{dead}\"\n[host.\"http://{}\"]\n  capabilities = [\"pull\", \"resolve\"]\n",
        reg.addr
    );
    std::fs::write(dir.join("hosts.toml"), toml).unwrap();
    let config = reg.docker_config(PASSWORD);
    let node = Node::start_with(&format!(
        "hosts_dir = \"{}\"\ndocker_config = \"{}\"",
        hosts.path().display(),
        config.display()
    ));
    let login = format!("{USER}:{PASSWORD}");
    pull_lazily_from(
        &node,
        &format!("127.0.0.1:{dead}"),
        &["--plain-http", "--hosts-dir", hosts.path().to_str().unwrap(), "--user", &login],
    );
}

#[test]
#[ignore = "needs root, containerd, docker-registry, openssl and the test registry: run by .ci/run"]
fn a_registry_that_asks_for_a_client_certificate_is_read_with_the_one_in_hosts_toml() {
    let reg = AuthRegistry::start(Auth::MutualTls);
    let ca = reg.ca.clone().unwrap();
    let (cert, key) = reg.client.clone().unwrap();
    let setting = format!("ca = \"{}\"\n  client = [[\"{}\", \"{}\"]]", ca.display(), cert.display(), key.display());
    // containerd reads the same hosts dir, with the same certificate.
    let hosts = tls_hosts(&reg.addr, &setting);
    let flags = ["--hosts-dir", hosts.path().to_str().unwrap()];
    let node = Node::start_with(&format!("hosts_dir = \"{}\"", hosts.path().display()));
    pull_lazily_from(&node, &reg.addr, &flags);
    drop(node);

    // Without the certificate, Strata's handshake is refused and the layer is not lazy; the
    // reason says so.
    let plain = tls_hosts(&reg.addr, &format!("ca = \"{}\"", ca.display()));
    let node = Node::start_with(&format!("hosts_dir = \"{}\"", plain.path().display()));
    let image = format!("{}/strata/busybox:esgz", reg.addr);
    let out = node.containerd.ctr_remote(&["image", "rpull", "--snapshotter", "strata", flags[0], flags[1], &image]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let layer = &node.layer_digests("busybox:esgz")[0];
    let l = node.layer_when(layer, |l| l["image"] == image.as_str());
    assert_eq!((&l["lazy"], &l["how"]), (&false.into(), &"containerd".into()), "{l:#}");
}

/// A hosts dir with one `hosts.toml` for the HTTPS registry at `addr`, its `[host]` entry
/// carrying `setting` (a `ca`, `skip_verify`, or nothing).
fn tls_hosts(addr: &str, setting: &str) -> tempfile::TempDir {
    let hosts = tempfile::tempdir().unwrap();
    let dir = hosts.path().join(addr);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("hosts.toml"),
        format!(
            "server = \"https://{addr}\"\n[host.\"https://{addr}\"]\n  capabilities = [\"pull\", \"resolve\"]\n  {setting}\n"
        ),
    )
    .unwrap();
    hosts
}

#[test]
#[ignore = "needs root, containerd, docker-registry, openssl and the test registry: run by .ci/run"]
fn a_tls_registry_is_read_with_its_ca_or_skip_verify_and_refused_otherwise() {
    let reg = AuthRegistry::start(Auth::Tls);
    let ca = reg.ca.clone().unwrap();
    // containerd trusts the registry's CA throughout; Strata's own hosts dir varies.
    let containerd_hosts = tls_hosts(&reg.addr, &format!("ca = \"{}\"", ca.display()));
    let ctr_flags = ["--hosts-dir", containerd_hosts.path().to_str().unwrap()];
    // The CA named in hosts.toml relative to the file, as containerd reads it.
    let relative = tls_hosts(&reg.addr, "ca = \"registry-ca.pem\"");
    std::fs::copy(&ca, relative.path().join(&reg.addr).join("registry-ca.pem")).unwrap();
    for hosts in [relative, tls_hosts(&reg.addr, "skip_verify = true")] {
        let node = Node::start_with(&format!("hosts_dir = \"{}\"", hosts.path().display()));
        pull_lazily_from(&node, &reg.addr, &ctr_flags);
    }

    // Neither: Strata refuses the certificate and says so; containerd, which trusts the CA,
    // fetches the layers itself, and the container still runs.
    let hosts = tls_hosts(&reg.addr, "");
    let node = Node::start_with(&format!("hosts_dir = \"{}\"", hosts.path().display()));
    let image = format!("{}/strata/busybox:esgz", reg.addr);
    let out =
        node.containerd.ctr_remote(&["image", "rpull", "--snapshotter", "strata", ctr_flags[0], ctr_flags[1], &image]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let layer = &node.layer_digests("busybox:esgz")[0];
    let l = node.layer_when(layer, |l| l["image"] == image.as_str());
    assert_eq!((&l["lazy"], &l["how"]), (&false.into(), &"containerd".into()), "{l:#}");
    let reason = l["reason"].as_str().unwrap();
    assert!(reason.contains("certificate"), "the reason names the untrusted certificate: {reason}");
    let out = node.run_out(&image, "untrusted", &["cat", "/etc/motd"]);
    assert_eq!(out, "strata layer two\n");
}

/// The registry throttles (503 with `SlowDown`), fails (500), resets and stalls range reads of
/// a lazy layer's blob: each is retried, and the container starts and prints its line.
#[test]
#[ignore = "needs root, containerd, runc, ctr-remote and the test registry: run by .ci/run"]
fn a_registry_that_throttles_resets_or_stalls_range_reads_is_retried() {
    let proxy = FaultyRegistry::start(&registry());
    let layers = Node::start().layer_digests("busybox:esgz");
    let image = format!("{}/strata/busybox:esgz", proxy.addr);
    let blob = format!("GET /v2/strata/busybox/blobs/{}", layers[0]);
    let faults = [
        Fault::Status { pattern: blob.clone(), times: 2, status: 503, code: "SlowDown".into() },
        Fault::Status { pattern: blob.clone(), times: 2, status: 500, code: "InternalError".into() },
        Fault::Reset { pattern: blob.clone(), times: 2 },
        Fault::Stall { pattern: blob.clone(), times: 1 },
    ];
    for (i, fault) in faults.into_iter().enumerate() {
        // A node of its own each time, so that the container's reads fetch from the registry.
        let node = Node::start_with("background_fetch = false\nfetch_image_program = false");
        let out = node.containerd.ctr_remote(&["image", "rpull", "--plain-http", "--snapshotter", "strata", &image]);
        assert!(out.status.success(), "rpull: {}", String::from_utf8_lossy(&out.stderr));
        let before = proxy.requests_for(&blob);
        proxy.set(fault.clone());
        let started = std::time::Instant::now();
        let out = node.run_out(&image, &format!("faulty-{i}"), &["busybox", "echo", &format!("started {i}")]);
        eprintln!("{fault:?}: started in {:?}", started.elapsed());
        assert_eq!(out, format!("started {i}\n"), "{fault:?}:\n{}", node.daemon.log());
        assert!(proxy.requests_for(&blob) > before + 1, "{fault:?} was never hit");
        proxy.set(Fault::None);
    }
}
