//! Directory renames through real FUSE mounts of the Ceph RGW that `.ci/run` starts: the
//! checkpoint pattern of Orbax (and of any tool that writes a temp directory and renames it into
//! place), a store that fails part-way through one, and a mount killed in the middle of one.

mod common;

use common::faulty::{Fault, FaultyRegistry};
use common::s3::*;
use common::*;
use std::path::Path;
use std::time::Duration;

/// Writes `files` (path, bytes) under `dir`, creating directories, each fsynced and closed.
fn write_tree(dir: &Path, files: &[(String, Vec<u8>)]) {
    use std::io::Write;
    for (rel, bytes) in files {
        let p = dir.join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        let mut f = std::fs::File::create(&p).unwrap();
        f.write_all(bytes).unwrap();
        f.sync_all().unwrap();
    }
}

fn checkpoint(seed: u64, shards: usize, shard_len: usize) -> Vec<(String, Vec<u8>)> {
    let mut files = vec![("_CHECKPOINT_METADATA".to_string(), format!("{{\"step\": {seed}}}").into_bytes())];
    for i in 0..shards {
        files.push((format!("state/shard{i}"), data(seed * 100 + i as u64, shard_len)));
    }
    files
}

fn keys(prefix: &str, dir: &str, files: &[(String, Vec<u8>)]) -> Vec<String> {
    let mut k: Vec<String> = files.iter().map(|(rel, _)| format!("{prefix}{dir}/{rel}")).collect();
    k.sort();
    k
}

/// Orbax writes a checkpoint into `NAME.orbax-checkpoint-tmp-N/` and renames that directory to
/// `NAME` once every file is in. The rename moves every object, with the large shard going up in
/// parts first; nothing stays under the temp name; a second mount, standing in for another node,
/// reads it back identical. A non-empty destination is `ENOTEMPTY`, and `mv` of a directory
/// works (it asks for `RENAME_NOREPLACE` first).
#[test]
#[ignore = "needs root, /dev/fuse and Ceph RGW: run by .ci/run"]
fn fuse_root_rgw_a_checkpoint_directory_renamed_into_place_moves_whole() {
    let rgw = Rgw::from_env();
    let prefix = unique_prefix("dirmv");
    let mut a = rgw_mount_with(&rgw, &prefix, &["--part-size", "8MiB"]);
    let mut files = checkpoint(1, 3, 1 << 20);
    files.push(("state/large".to_string(), data(0x1A26E, 40 << 20)));
    let tmp = "ck.orbax-checkpoint-tmp-0";
    write_tree(&a.path(tmp), &files);
    std::fs::create_dir(a.path(&format!("{tmp}/empty"))).unwrap();
    assert_eq!(keys_under(&rgw, &prefix), keys(&prefix, tmp, &files));

    std::fs::rename(a.path(tmp), a.path("ck")).expect("a directory rename");
    assert_eq!(keys_under(&rgw, &prefix), keys(&prefix, "ck", &files), "every object moved, none left behind");
    assert!(!a.path(tmp).exists());
    assert!(a.path("ck/empty").is_dir(), "an empty directory made here moves too");
    for (rel, bytes) in &files {
        assert!(std::fs::read(a.path(&format!("ck/{rel}"))).unwrap() == *bytes, "{rel} through the renaming mount");
    }
    let b = rgw_mount(&rgw, &prefix);
    for (rel, bytes) in &files {
        assert!(std::fs::read(b.path(&format!("ck/{rel}"))).unwrap() == *bytes, "{rel} on a second mount");
    }
    drop(b);

    std::fs::create_dir(a.path("other")).unwrap();
    std::fs::write(a.path("other/f"), b"f").unwrap();
    let err = std::fs::rename(a.path("ck"), a.path("other")).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(39), "onto a non-empty directory: ENOTEMPTY");
    assert_eq!(get(&rgw, &format!("{prefix}ck/_CHECKPOINT_METADATA")), files[0].1, "a refused rename moves nothing");

    // Swapping two names needs an atomicity S3 does not have (renameat2 through python's
    // ctypes: AT_FDCWD is -100, RENAME_EXCHANGE 2).
    let swap = "import ctypes, sys\nlibc = ctypes.CDLL(None, use_errno=True)\n\
                r = libc.renameat2(-100, sys.argv[1].encode(), -100, sys.argv[2].encode(), 2)\n\
                print(r, ctypes.get_errno())";
    let out = std::process::Command::new("python3").args(["-c", swap]).arg(a.path("ck")).arg(a.path("other")).output();
    let out = out.unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "-1 22", "RENAME_EXCHANGE: EINVAL");

    let mv = std::process::Command::new("mv").arg(a.path("ck")).arg(a.path("ck2")).output().unwrap();
    assert!(mv.status.success(), "mv: {}", String::from_utf8_lossy(&mv.stderr));
    assert_eq!(keys_under(&rgw, &format!("{prefix}ck2/")), keys(&prefix, "ck2", &files));
    assert!(keys_under(&rgw, &format!("{prefix}ck/")).is_empty());
    a.stop();
    delete_under(&rgw, &prefix);
}

/// The store stops taking copies part-way through a directory rename: the rename fails with
/// `EIO`, the copies already made go, and the directory stays whole under its old name. Once the
/// store is back, the same rename succeeds.
#[test]
#[ignore = "needs root, /dev/fuse and Ceph RGW: run by .ci/run"]
fn fuse_root_rgw_a_store_failing_mid_rename_leaves_the_directory_under_its_old_name() {
    let rgw = Rgw::from_env();
    let proxy = FaultyRegistry::start(rgw.endpoint.trim_start_matches("http://"));
    let prefix = unique_prefix("dirfail");
    let source = format!("s3://{}/{}", rgw.bucket, prefix.trim_end_matches('/'));
    let endpoint = format!("http://{}", proxy.addr);
    let mut m = Mount::start(&source, &["--endpoint", &endpoint, "--region", "us-east-1"]);
    let files = checkpoint(2, 8, 64 << 10);
    write_tree(&m.path("tmp"), &files);

    // A copy is a PUT of the new key; the deletes that undo the copies still go through.
    proxy.set(Fault::RefuseAfter { pattern: format!("PUT /{}/{prefix}ck/", rgw.bucket), after: 2 });
    let err = std::fs::rename(m.path("tmp"), m.path("ck")).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(5), "EIO: {err}\n{}", m.log());
    assert_eq!(keys_under(&rgw, &prefix), keys(&prefix, "tmp", &files), "the old name whole, nothing under the new");
    assert!(!m.path("ck").exists());
    for (rel, bytes) in &files {
        assert!(std::fs::read(m.path(&format!("tmp/{rel}"))).unwrap() == *bytes, "{rel} under the old name");
    }

    proxy.set(Fault::None);
    std::fs::rename(m.path("tmp"), m.path("ck")).unwrap();
    assert_eq!(keys_under(&rgw, &prefix), keys(&prefix, "ck", &files));
    m.stop();
    delete_under(&rgw, &prefix);
}

/// The mount is killed while a directory rename is copying: some objects are under the new
/// name, all still under the old. The next start of the mount, on the same state dir, finishes
/// the rename from its journal before it serves anything: every object under the new name,
/// none under the old.
#[test]
#[ignore = "needs root, /dev/fuse and Ceph RGW: run by .ci/run"]
fn fuse_root_rgw_a_crash_mid_rename_is_finished_at_the_next_start() {
    let rgw = Rgw::from_env();
    let proxy = FaultyRegistry::start(rgw.endpoint.trim_start_matches("http://"));
    let prefix = unique_prefix("dircrash");
    let source = format!("s3://{}/{}", rgw.bucket, prefix.trim_end_matches('/'));
    let through_proxy = format!("http://{}", proxy.addr);
    let mut m = Mount::start_in(
        tempfile::tempdir().unwrap(),
        &source,
        &["--endpoint", &through_proxy, "--region", "us-east-1"],
    );
    let files = checkpoint(3, 10, 32 << 10);
    write_tree(&m.path("tmp"), &files);

    proxy.set(Fault::HoldAfter { pattern: format!("PUT /{}/{prefix}ck/", rgw.bucket), after: 3 });
    let (from, to) = (m.path("tmp"), m.path("ck"));
    let renaming = std::thread::spawn(move || std::fs::rename(from, to));
    let copied = || keys_under(&rgw, &format!("{prefix}ck/")).len();
    wait_until(Duration::from_secs(30), || copied() == 3);
    assert_eq!(copied(), 3, "three copies made, the rest held:\n{}", m.log());
    let mut c = m.child.take().unwrap();
    c.kill().unwrap();
    c.wait().unwrap();
    assert!(renaming.join().unwrap().is_err(), "the killed mount's rename cannot have succeeded");
    assert_eq!(keys_under(&rgw, &format!("{prefix}tmp/")), keys(&prefix, "tmp", &files), "nothing deleted yet");
    wait_until(Duration::from_secs(60), || !mounted(&m.mnt));
    assert!(!mounted(&m.mnt), "the killed mount was never unmounted");

    let dir = std::mem::replace(&mut m._dir, tempfile::tempdir().unwrap());
    let mut again = Mount::start_in(dir, &source, &["--endpoint", &rgw.endpoint, "--region", "us-east-1"]);
    assert!(again.log().contains("tmp -> ck: a rename cut short by a crash was finished"), "{}", again.log());
    assert_eq!(keys_under(&rgw, &prefix), keys(&prefix, "ck", &files), "the rename finished, nothing left behind");
    for (rel, bytes) in &files {
        assert!(std::fs::read(again.path(&format!("ck/{rel}"))).unwrap() == *bytes, "{rel} after the restart");
    }
    again.stop();
    delete_under(&rgw, &prefix);
}
