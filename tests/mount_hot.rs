//! The hot tier through real mounts of the daemon. FUSE passthrough: a file whole in the hot
//! tier is read by the kernel straight from a local copy, so the daemon serves none of its
//! bytes, and opens still count as accesses for the policy. Checkpoints: the newest one written
//! into a directory stays hot. Needs root and /dev/fuse, so `.ci/run` runs these.

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

const HOT_READ: &str = "strata_tier_read_bytes_total{tier=\"hot\"}";
const WARM_READ: &str = "strata_tier_read_bytes_total{tier=\"warm\"}";
const PASSTHROUGH_OPENS: &str = "strata_fs_opens_total{mode=\"passthrough\"}";

fn dataset(files: &[(&str, &[u8])], passthrough: bool) -> (tempfile::TempDir, tempfile::TempDir, Daemon) {
    dataset_with(files, &format!("passthrough = {passthrough}\n"))
}

fn dataset_with(files: &[(&str, &[u8])], mount_toml: &str) -> (tempfile::TempDir, tempfile::TempDir, Daemon) {
    dataset_in(files, mount_toml, "256MiB")
}

/// A daemon mounting `files`, with a hot tier of `hot` bytes and a warm tier of 256 MiB.
fn dataset_in(files: &[(&str, &[u8])], mount_toml: &str, hot: &str) -> (tempfile::TempDir, tempfile::TempDir, Daemon) {
    let cold = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(cold.path().join("ds")).unwrap();
    for (name, bytes) in files {
        std::fs::write(cold.path().join("ds").join(name), bytes).unwrap();
    }
    let mnt = tempfile::tempdir().unwrap();
    let body = format!(
        "[cold]\nkind = \"local\"\npath = \"{}\"\nchunk_size = \"1MiB\"\n\
         [[mounts]]\npath = \"{}\"\nprefix = \"ds\"\n{mount_toml}",
        cold.path().display(),
        mnt.path().display()
    );
    let d = Daemon::start(&body, hot, "256MiB");
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
    let served = d.metric(HOT_READ);
    assert_eq!(std::fs::read(&path).unwrap(), a);
    assert_eq!(d.metric(HOT_READ), served, "the daemon served bytes of a file whole in the hot tier");
    assert!(d.metric(PASSTHROUGH_OPENS) >= 1, "no open passed through:\n{}", d.metrics_text());

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
fn fuse_root_a_hot_tier_with_room_for_the_copies_but_not_the_chunks_too_keeps_every_copy() {
    // Twelve files of one 1 MiB chunk each: read whole, each is held twice in the hot tier, as
    // its chunk and as its copy, 24 MiB against a tier of 20 (18 below its high watermark).
    // The copies alone fit, so a second epoch should find every file whole there.
    let files: Vec<(String, Vec<u8>)> = (0..12).map(|i| (format!("f{i:02}.bin"), data(40 + i, 1 << 20))).collect();
    let refs: Vec<(&str, &[u8])> = files.iter().map(|(n, b)| (n.as_str(), b.as_slice())).collect();
    let (_cold, mnt, mut d) = dataset_in(&refs, "passthrough = true\n", "20MiB");
    for (i, (name, bytes)) in files.iter().enumerate() {
        assert_eq!(&std::fs::read(mnt.path().join(name)).unwrap(), bytes, "{name}");
        // The copy of each file read so far must still be there once the next is made.
        wait_for_whole_copies(d.state(), i + 1, || d.log());
    }
    let st = d.status();
    assert!(tier(&st, "warm")["chunks"].as_u64().unwrap() >= 4, "the room came from chunks moved down: {st}");

    // The second epoch: every open passes through, and the daemon serves no byte of any file.
    whole_copies(d.state()).iter().for_each(|p| drop_pages(p));
    files.iter().for_each(|(name, _)| drop_pages(&mnt.path().join(name)));
    let (served_hot, served_warm) = (d.metric(HOT_READ), d.metric(WARM_READ));
    let opens = d.metric(PASSTHROUGH_OPENS);
    for (name, bytes) in &files {
        assert_eq!(&std::fs::read(mnt.path().join(name)).unwrap(), bytes, "{name}");
    }
    assert_eq!(d.metric(PASSTHROUGH_OPENS), opens + 12, "{}", d.metrics_text());
    assert_eq!((d.metric(HOT_READ), d.metric(WARM_READ)), (served_hot, served_warm));
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
    let served = d.metric(HOT_READ);
    assert_eq!(std::fs::read(&path).unwrap(), a);
    assert!(d.metric(HOT_READ) >= served + a.len() as u64, "the reread was not served by the daemon");
    assert_eq!(d.metric(PASSTHROUGH_OPENS), 0);
    d.stop();
}

const HOT_WRITTEN: &str = "strata_tier_written_bytes_total{tier=\"hot\"}";

/// A checkpoint written through the mount becomes its own passthrough copy: the staged file is
/// moved into the hot tier, not copied again, so the checkpoint's bytes are written locally
/// twice (staged, then as chunks), not three times, and the next open reads it at local speed.
#[test]
#[ignore = "needs root and /dev/fuse: run by .ci/run"]
fn fuse_root_a_written_checkpoint_becomes_its_own_whole_file_copy() {
    use std::io::Write;
    use std::os::unix::fs::MetadataExt;
    let bytes = data(51, (5 << 20) + 123);
    let (cold, mnt, mut d) = dataset_with(&[], "");
    let (tmp, path) = (mnt.path().join("model.pt.tmp"), mnt.path().join("model.pt"));
    let mut f = std::fs::File::create(&tmp).unwrap();
    f.write_all(&bytes).unwrap();
    let staged: Vec<PathBuf> =
        files_under(d.state()).into_iter().filter(|p| p.extension().is_some_and(|e| e == "data")).collect();
    assert_eq!(staged.len(), 1, "one staged file while writing: {staged:?}");
    let staged_ino = std::fs::metadata(&staged[0]).unwrap().ino();
    let written_before = d.metric(HOT_WRITTEN);
    f.sync_all().unwrap();
    drop(f);
    std::fs::rename(&tmp, &path).unwrap();
    assert_eq!(std::fs::read(cold.path().join("ds/model.pt")).unwrap(), bytes, "the object in the store");

    wait_for_whole_copies(d.state(), 1, || d.log());
    let copy = whole_copies(d.state()).remove(0);
    assert_eq!(std::fs::metadata(&copy).unwrap().ino(), staged_ino, "the whole-file copy is not the staged file");
    assert!(!staged[0].exists());
    // Only the chunks were written into the tier, from the copy once it was in place: their
    // headers and checksums add a little.
    wait_for_metric(&d, HOT_WRITTEN, written_before + bytes.len() as u64);
    let written = d.metric(HOT_WRITTEN) - written_before;
    assert!(
        written >= bytes.len() as u64 && written < bytes.len() as u64 * 3 / 2,
        "{written} bytes written into the hot tier for a checkpoint of {}",
        bytes.len()
    );

    drop_pages(&copy);
    let served = d.metric(HOT_READ);
    assert_eq!(sha(&std::fs::read(&path).unwrap()), sha(&bytes));
    assert_eq!(d.metric(HOT_READ), served, "the daemon served bytes of the checkpoint it just wrote");
    assert!(d.metric(PASSTHROUGH_OPENS) >= 1, "no open passed through:\n{}", d.metrics_text());
    d.stop();
}

/// A reader that jumps about in a file cached hot, through the daemon (passthrough off), gets
/// each read from the pieces of the chunk it touches: the hot tier gives up the bytes asked
/// for, not a whole 1 MiB chunk per 256 KiB read.
#[test]
#[ignore = "needs root and /dev/fuse: run by .ci/run"]
fn fuse_root_random_reads_of_a_hot_file_load_only_the_pieces_they_touch() {
    use std::os::unix::fs::{FileExt, OpenOptionsExt};
    const MIB: u64 = 1 << 20;
    let bytes = data(61, 24 << 20);
    let (_cold, mnt, mut d) = dataset(&[("shuffled.bin", &bytes)], false);
    let path = mnt.path().join("shuffled.bin");
    assert_eq!(sha(&std::fs::read(&path).unwrap()), sha(&bytes));
    let deadline = Instant::now() + Duration::from_secs(30);
    while tier(&d.status(), "hot")["chunks"].as_u64() < Some(24) {
        assert!(Instant::now() < deadline, "the file never got all hot:\n{}", d.status());
        std::thread::sleep(Duration::from_millis(100));
    }

    // O_DIRECT, so the kernel hands each read to the daemon as it is; each jumps 2 MiB back,
    // which ends any sequential run.
    let f = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_DIRECT).open(&path).unwrap();
    let before = d.metric(HOT_READ);
    let mut buf = vec![0u8; 256 << 10];
    for at in [23 * MIB, 21 * MIB + (256 << 10), 19 * MIB + (512 << 10), 17 * MIB + (768 << 10)] {
        f.read_exact_at(&mut buf, at).unwrap();
        assert!(buf == bytes[at as usize..at as usize + buf.len()], "wrong bytes at {at}");
    }
    assert_eq!(d.metric(HOT_READ) - before, 4 * (256 << 10), "the hot tier gave more than was asked for");
    d.stop();
}

/// `tier policy show` once it mentions `want`: pins follow a write in the background.
fn policy_with(d: &Daemon, want: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let policy = d.tier_ok(&["policy", "show"]);
        if policy.contains(want) || Instant::now() > deadline {
            return policy;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn write_via_rename(dir: &Path, name: &str, bytes: &[u8]) {
    let tmp = dir.join(format!("{name}.tmp"));
    let mut f = std::fs::File::create(&tmp).unwrap();
    std::io::Write::write_all(&mut f, bytes).unwrap();
    f.sync_all().unwrap();
    drop(f);
    std::fs::rename(&tmp, dir.join(name)).unwrap();
}

#[test]
#[ignore = "needs root and /dev/fuse: run by .ci/run"]
fn fuse_root_the_newest_checkpoint_of_a_directory_stays_hot() {
    let (e1, e2, s0, s1) = (data(41, 3 << 20), data(42, 3 << 20), data(43, 2 << 20), data(44, 2 << 20));
    let (_cold, mnt, mut d) = dataset_with(&[], "checkpoint_window = \"1s\"\n");
    let ckpt = mnt.path().join("ckpt");
    std::fs::create_dir(&ckpt).unwrap();

    // Whole-file checkpoints, written to a temp name and renamed, as torch.save users do, some
    // time apart: ckpt/ is a directory of checkpoints, and only the newest stays pinned.
    write_via_rename(&ckpt, "e1.pt", &e1);
    std::thread::sleep(Duration::from_millis(1500));
    write_via_rename(&ckpt, "e2.pt", &e2);
    let want = "=ds/ckpt/e2.pt -> hot (newest written into ds/ckpt/)";
    let policy = policy_with(&d, want);
    assert!(policy.contains(want), "{policy}");
    assert!(!policy.contains("e1.pt ->"), "the older checkpoint is still pinned:\n{policy}");
    assert!(!policy.contains("ds/ckpt/ ->"), "a directory of checkpoints is pinned whole:\n{policy}");
    // Everything idle goes down to warm, except the newest checkpoint (its 3 chunks stay).
    let out = d.tier_ok(&["demote", "--idle", "0s"]);
    assert!(out.contains("demoted 3 chunks"), "only e1's chunks should leave hot: {out}");

    // A sharded checkpoint: a new step directory made through the mount becomes the newest
    // entry of ckpt/, so all its shards stay hot and e2 goes back to the ordinary policy.
    let step = ckpt.join("step3");
    std::fs::create_dir(&step).unwrap();
    std::fs::write(step.join("shard0"), &s0).unwrap();
    std::fs::write(step.join("shard1"), &s1).unwrap();
    let want = "ds/ckpt/step3/ -> hot (newest written into ds/ckpt/)";
    let policy = policy_with(&d, want);
    assert!(policy.contains(want), "{policy}");
    assert!(!policy.contains("e2.pt ->"), "{policy}");
    let out = d.tier_ok(&["demote", "--idle", "0s"]);
    assert!(out.contains("demoted 3 chunks"), "only e2's chunks should leave hot: {out}");

    // Every checkpoint still reads back whole, wherever its chunks are.
    for (name, want) in [("e1.pt", &e1), ("e2.pt", &e2), ("step3/shard0", &s0), ("step3/shard1", &s1)] {
        assert_eq!(sha(&std::fs::read(ckpt.join(name)).unwrap()), sha(want), "{name}");
    }
    d.stop();
}

const PARTS_WHILE_WRITING: &str = "strata_fs_parts_sent_while_writing_total";
const FOREIGN_FLUSHES: &str = "strata_fs_flushes_by_other_processes_total";

fn wait_for_metric(d: &Daemon, sample: &str, at_least: u64) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while d.metric(sample) < at_least {
        assert!(Instant::now() < deadline, "{sample} stayed below {at_least}:\n{}", d.metrics_text());
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Resident bytes of `path` in the page cache, by `fincore`.
fn resident(path: &Path) -> u64 {
    let out = Command::new("fincore").args(["--bytes", "--noheadings", "--raw", "--output", "RES"]).arg(path).output();
    let out = out.expect("fincore (util-linux) runs");
    assert!(out.status.success(), "fincore {}: {}", path.display(), String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).trim().parse().expect("fincore prints a byte count")
}

/// A checkpoint written front to back goes to its staged file in whole parts with direct I/O,
/// and each part goes up from memory: the node's page cache, which holds its datasets, is not
/// filled with the checkpoint. The object is still exactly what was written.
#[test]
#[ignore = "needs root and /dev/fuse: run by .ci/run"]
fn fuse_root_a_checkpoint_written_front_to_back_stays_out_of_the_page_cache() {
    use std::io::Write;
    const PART: usize = 5 << 20;
    let (cold, mnt, mut d) = dataset_with(&[], "part_size = \"5MiB\"\nupload_parallel = 2\n");
    let bytes = data(41, 4 * PART + 4321);
    let mut f = std::fs::File::create(mnt.path().join("step9.pt")).unwrap();
    for piece in bytes.chunks(1 << 20) {
        f.write_all(piece).unwrap();
    }
    let staged: Vec<PathBuf> =
        files_under(d.state()).into_iter().filter(|p| p.extension().is_some_and(|e| e == "data")).collect();
    assert_eq!(staged.len(), 1, "one staged file while writing: {staged:?}");
    assert_eq!(std::fs::metadata(&staged[0]).unwrap().len(), 4 * PART as u64, "the whole parts are in the file");
    // Through the page cache, all 20 MiB would be resident now.
    let cached = resident(&staged[0]);
    assert!(cached < PART as u64, "{cached} bytes of the staged checkpoint are in the page cache");
    wait_for_metric(&d, PARTS_WHILE_WRITING, 2);
    f.sync_all().unwrap();
    drop(f);
    assert_eq!(sha(&std::fs::read(cold.path().join("ds/step9.pt")).unwrap()), sha(&bytes), "the object");
    assert_eq!(sha(&std::fs::read(mnt.path().join("step9.pt")).unwrap()), sha(&bytes), "read back through the mount");
    d.stop();
}

/// A checkpoint larger than a part goes up while it is written: parts are in the store before
/// the writer's fsync, yet the object appears only when the fsync completes the upload. A crash
/// before that leaves no object, and the restart reports the staged file rather than upload a
/// part of it.
#[test]
#[ignore = "needs root and /dev/fuse: run by .ci/run"]
fn fuse_root_checkpoints_go_up_while_written_and_appear_only_when_complete() {
    use std::io::Write;
    let (cold, mnt, mut d) = dataset_with(&[], "part_size = \"5MiB\"\nupload_parallel = 2\n");
    let bytes = data(31, 23 << 20);
    let object = cold.path().join("ds/ckpt.pt");
    let mut f = std::fs::File::create(mnt.path().join("ckpt.pt")).unwrap();
    f.write_all(&bytes).unwrap();
    // Writes start parts while fewer than upload_parallel are in flight, so the first two are
    // sure to go; how many more did depends on how fast the store took them.
    wait_for_metric(&d, PARTS_WHILE_WRITING, 2);
    assert!(!object.exists(), "the object is visible before the writer's fsync");
    // A child's exec closes its copy of the descriptor: a flush, by another process.
    assert!(std::process::Command::new("true").status().unwrap().success());
    assert_eq!(d.metric(FOREIGN_FLUSHES), 1, "the child's close was a flush by another process");
    assert!(!object.exists(), "a child's close published the half-written checkpoint");
    f.sync_all().unwrap();
    assert_eq!(std::fs::read(&object).unwrap(), bytes, "the object after fsync is not what was written");
    drop(f);

    let cut = cold.path().join("ds/cut.pt");
    let mut g = std::fs::File::create(mnt.path().join("cut.pt")).unwrap();
    let before = d.metric(PARTS_WHILE_WRITING);
    g.write_all(&bytes[..12 << 20]).unwrap();
    wait_for_metric(&d, PARTS_WHILE_WRITING, before + 2);
    d.kill9();
    drop(g);
    assert!(!cut.exists(), "a crash mid-write left an object behind");
    let deadline = Instant::now() + Duration::from_secs(60);
    while mounted(mnt.path()) {
        assert!(Instant::now() < deadline, "the killed mount was never unmounted");
        std::thread::sleep(Duration::from_millis(50));
    }
    d.spawn();
    let deadline = Instant::now() + Duration::from_secs(30);
    while !mounted(mnt.path()) {
        assert!(Instant::now() < deadline, "the restarted daemon did not mount:\n{}", d.log());
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(d.log().contains("cut.pt: left incomplete"), "the cut-off file was not reported:\n{}", d.log());
    assert!(!cut.exists(), "the restart uploaded a cut-off file");
    let names: Vec<String> =
        std::fs::read_dir(mnt.path()).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    assert_eq!(names, ["ckpt.pt"], "the mount shows something besides the checkpoint");
    assert_eq!(std::fs::read(mnt.path().join("ckpt.pt")).unwrap(), bytes);
    d.stop();
}
