//! FUSE passthrough through real mounts of the daemon: a file whole in the hot tier is read by
//! the kernel straight from a local copy, so the daemon serves none of its bytes; opens still
//! count as accesses for the policy. Needs root and /dev/fuse, so `.ci/run` runs these.

mod common;

use common::*;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

fn whole_copies(state: &Path) -> Vec<PathBuf> {
    files_under(state).into_iter().filter(|p| p.extension().is_some_and(|e| e == "file")).collect()
}

/// Waits until `n` whole-file copies exist under `state`: the mount assembles them in the
/// background once a file's chunks are all in the hot tier.
fn wait_for_whole_copies(state: &Path, n: usize, log: impl Fn() -> String) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while whole_copies(state).len() < n {
        assert!(Instant::now() < deadline, "fewer than {n} whole-file copies after 30s:\n{}", log());
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Drops the cached pages of one file, so the next read goes to its backing store.
fn drop_pages(path: &Path) {
    let st = Command::new("dd").arg(format!("if={}", path.display())).args(["iflag=nocache", "count=0"]).status();
    assert!(st.unwrap().success());
}

/// The value of one sample of the daemon's metrics, 0 when absent.
fn metric(d: &Daemon, sample: &str) -> u64 {
    let text = d.metrics_text();
    text.lines()
        .find_map(|l| l.strip_prefix(sample).and_then(|v| v.trim().parse::<f64>().ok()))
        .map(|v| v as u64)
        .unwrap_or(0)
}

const HOT_READ: &str = "strata_tier_read_bytes_total{tier=\"hot\"}";
const PASSTHROUGH_OPENS: &str = "strata_fs_opens_total{mode=\"passthrough\"}";

fn dataset(files: &[(&str, &[u8])], passthrough: bool) -> (tempfile::TempDir, tempfile::TempDir, Daemon) {
    let cold = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(cold.path().join("ds")).unwrap();
    for (name, bytes) in files {
        std::fs::write(cold.path().join("ds").join(name), bytes).unwrap();
    }
    let mnt = tempfile::tempdir().unwrap();
    let body = format!(
        "[cold]\nkind = \"local\"\npath = \"{}\"\nchunk_size = \"1MiB\"\n\
         [[mounts]]\npath = \"{}\"\nprefix = \"ds\"\npassthrough = {passthrough}\n",
        cold.path().display(),
        mnt.path().display()
    );
    let d = Daemon::start(&body, "256MiB", "256MiB");
    assert!(mounted(mnt.path()), "the daemon did not mount its dataset:\n{}", d.log());
    (cold, mnt, d)
}

#[test]
#[ignore = "needs root and /dev/fuse: run by .ci/run"]
fn fuse_root_whole_hot_files_pass_through_and_stay_hot_for_the_policy() {
    let (a, b) = (data(23, 3 << 20), data(24, 3 << 20));
    let (_cold, mnt, mut d) = dataset(&[("opened.bin", &a), ("idle.bin", &b)], true);
    assert_eq!(std::fs::read(mnt.path().join("opened.bin")).unwrap(), a);
    assert_eq!(std::fs::read(mnt.path().join("idle.bin")).unwrap(), b);
    wait_for_whole_copies(d.state(), 2, || d.log());
    std::thread::sleep(Duration::from_secs(3));

    // Read again from disk, not from any page cache: the kernel reads the local copy itself, so
    // the daemon serves none of the bytes, and they are the object's.
    let path = mnt.path().join("opened.bin");
    drop_pages(&path);
    whole_copies(d.state()).iter().for_each(|p| drop_pages(p));
    let served = metric(&d, HOT_READ);
    assert_eq!(std::fs::read(&path).unwrap(), a);
    assert_eq!(metric(&d, HOT_READ), served, "the daemon served bytes of a file whole in the hot tier");
    assert!(metric(&d, PASSTHROUGH_OPENS) >= 1, "no open passed through:\n{}", d.metrics_text());

    // Only `opened.bin` was opened since: the open alone marks its chunks as used, so an idle
    // demotion moves just `idle.bin` down (its whole-file copy is dropped, not moved).
    let out = d.tier_ok(&["demote", "--idle", "2s"]);
    assert!(out.contains("demoted 3 chunks"), "{out}");
    assert_eq!(whole_copies(d.state()).len(), 1);
    assert_eq!(tier(&d.status(), "hot")["chunks"], 4, "3 chunks and the copy of opened.bin");
    assert_eq!(std::fs::read(mnt.path().join("idle.bin")).unwrap(), b);
    d.stop();
}

#[test]
#[ignore = "needs root and /dev/fuse: run by .ci/run"]
fn fuse_root_without_passthrough_the_daemon_serves_every_read() {
    // The control of the test above: the same steps with passthrough off show the daemon
    // serving the bytes, so the counter really tells the two paths apart.
    let a = data(25, 3 << 20);
    let (_cold, mnt, mut d) = dataset(&[("f.bin", &a)], false);
    let path = mnt.path().join("f.bin");
    assert_eq!(std::fs::read(&path).unwrap(), a);
    d.tier_ok(&["status"]);
    std::thread::sleep(Duration::from_secs(2));
    assert!(whole_copies(d.state()).is_empty(), "passthrough = false still made a whole-file copy");
    drop_pages(&path);
    let served = metric(&d, HOT_READ);
    assert_eq!(std::fs::read(&path).unwrap(), a);
    assert!(metric(&d, HOT_READ) >= served + a.len() as u64, "the reread was not served by the daemon");
    assert_eq!(metric(&d, PASSTHROUGH_OPENS), 0);
    d.stop();
}
