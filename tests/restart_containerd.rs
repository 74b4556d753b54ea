//! A running container on lazy eStargz layers through daemon restarts, on real containerd,
//! runc and the test registry: under `strata supervise`, the container reads files it has not
//! read before, one after another, while the daemon is SIGKILLed and started again and then
//! hands over (SIGUSR2). It sees no error, and every file's bytes are those of the original
//! image as containerd's own overlayfs snapshotter serves it.

mod common;

use common::containerd::registry;
use common::node::Node;
use std::path::Path;
use std::time::{Duration, Instant};

/// The files the container reads: Python's standard library, a few hundred, in order.
const LIST: &str = "find /usr/lib/python3* -type f -name '*.py' | sort | head -500";

fn count(out: &Path) -> usize {
    std::fs::read_to_string(out.join("count")).ok().and_then(|s| s.trim().parse().ok()).unwrap_or(0)
}

fn wait_for(what: &str, limit: Duration, done: impl Fn() -> bool, log: impl Fn() -> String) {
    let deadline = Instant::now() + limit;
    while !done() {
        assert!(Instant::now() < deadline, "{what} did not happen in {limit:?}:\n{}", log());
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
#[ignore = "needs root, containerd, runc, ctr-remote and the test registry: run by .ci/run"]
fn a_container_on_lazy_layers_reads_new_files_right_through_a_kill_and_a_handover() {
    let mut node = Node::start_supervised();
    // The bytes to expect: the original image, pulled whole onto containerd's overlayfs.
    let original = format!("{}/strata/python:1", registry());
    node.ctr(&["images", "pull", "--plain-http", &original]);
    let log = node.daemon.log();
    let script = format!("{LIST} | while read f; do md5sum \"$f\"; done");
    let want = node.containerd.run_captured("overlayfs", &original, "original", &script, &log);
    assert!(want.lines().count() >= 200, "too few files to read: {want}");

    let image = node.rpull("python:esgz");
    let out = tempfile::tempdir().unwrap();
    let bind = format!("type=bind,src={},dst=/out,options=rbind:rw", out.path().display());
    // One file at a time, slowly enough that the reads span both restarts; a failed read is
    // written down, not stopped at.
    let reader = format!(
        "{LIST} > /out/list; n=0; while read f; do \
           md5sum \"$f\" >> /out/sums 2>> /out/errors || echo \"failed: $f\" >> /out/errors; \
           n=$((n+1)); echo $n > /out/count; sleep 0.02; \
         done < /out/list; echo done > /out/done"
    );
    node.ctr(&["run", "-d", "--snapshotter", "strata", "--mount", &bind, &image, "reader", "sh", "-c", &reader]);
    let log = || node.daemon.log();
    wait_for("the first reads", Duration::from_secs(60), || count(out.path()) >= 40, log);

    let at_kill = count(out.path());
    let killed = node.daemon.restart_with("KILL");
    let log = || node.daemon.log();
    wait_for("reads after the kill", Duration::from_secs(60), || count(out.path()) >= at_kill + 60, log);
    let at_handover = count(out.path());
    let handed = node.daemon.restart_with("USR2");
    let log = || node.daemon.log();
    wait_for("reads after the handover", Duration::from_secs(60), || count(out.path()) > at_handover + 20, log);
    wait_for("the end of the reads", Duration::from_secs(120), || out.path().join("done").exists(), log);

    let errors = std::fs::read_to_string(out.path().join("errors")).unwrap_or_default();
    assert_eq!(errors, "", "the container saw errors:\n{}", node.daemon.log());
    let got = std::fs::read_to_string(out.path().join("sums")).unwrap();
    assert_eq!(got, want, "the container read other bytes than the image holds");
    let log = node.daemon.log();
    let took_over = log.matches("took over the mount an earlier run left").count();
    // Every layer of the image, at each of the two restarts.
    let layers = node.layer_digests("python:esgz").len();
    assert_eq!(took_over, 2 * layers, "{took_over} takeovers of {layers} layers:\n{log}");
    eprintln!("restart after SIGKILL {killed:?}, handover {handed:?}; reads at them {at_kill}, {at_handover}");
}
