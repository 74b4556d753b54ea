//! End-to-end tests of `strata mount` through real FUSE mounts: of a bucket prefix on the Ceph
//! RGW that `.ci/run` starts, and of a local directory. They need root and /dev/fuse, so they
//! are ignored in a plain `cargo test` and run by `.ci/run`.

mod common;

use common::*;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

struct Mount {
    child: Option<Child>,
    mnt: PathBuf,
    log: PathBuf,
    _dir: tempfile::TempDir,
}

fn mounted(mnt: &Path) -> bool {
    let m = std::fs::read_to_string("/proc/mounts").unwrap();
    let needle = format!(" {} fuse.strata ", mnt.display());
    m.contains(&needle)
}

impl Mount {
    fn start(source: &str, extra: &[&str]) -> Mount {
        let dir = tempfile::tempdir().unwrap();
        let mnt = dir.path().join("mnt");
        std::fs::create_dir(&mnt).unwrap();
        let log = dir.path().join("mount.log");
        let child = Command::new(BIN)
            .arg("mount")
            .arg(source)
            .arg(&mnt)
            .arg("--state-dir")
            .arg(dir.path().join("state"))
            .args(extra)
            .env("NO_COLOR", "1")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        let mut m = Mount { child: Some(child), mnt, log, _dir: dir };
        let deadline = Instant::now() + Duration::from_secs(30);
        while !mounted(&m.mnt) {
            if let Some(s) = m.child.as_mut().unwrap().try_wait().unwrap() {
                panic!("strata mount exited with {s}:\n{}", m.log());
            }
            assert!(Instant::now() < deadline, "not mounted after 30s:\n{}", m.log());
            std::thread::sleep(Duration::from_millis(50));
        }
        m
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn path(&self, rel: &str) -> PathBuf {
        self.mnt.join(rel)
    }

    /// SIGTERM, then the process must exit and take its mount with it.
    fn stop(&mut self) {
        let mut c = self.child.take().unwrap();
        Command::new("kill").arg("-TERM").arg(c.id().to_string()).status().unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        while c.try_wait().unwrap().is_none() {
            assert!(Instant::now() < deadline, "strata mount ignored SIGTERM:\n{}", self.log());
            std::thread::sleep(Duration::from_millis(50));
        }
        assert!(!mounted(&self.mnt), "the mount outlived its process");
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = Command::new("fusermount3").args(["-u", "-z"]).arg(&self.mnt).stderr(Stdio::null()).status();
    }
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap()
}

fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> =
        std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    v.sort();
    v
}

/// Deterministic offsets to probe with reads that straddle chunk boundaries.
fn probes(len: usize) -> Vec<(usize, usize)> {
    let mut x: u64 = 0x2545_F491_4F6C_DD1D;
    (0..40)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let off = (x as usize) % len.max(1);
            let n = ((x >> 20) as usize % 300_000).min(len - off);
            (off, n)
        })
        .collect()
}

fn check_random_reads(path: &Path, want: &[u8]) {
    let mut f = std::fs::File::open(path).unwrap();
    for (off, n) in probes(want.len()) {
        f.seek(SeekFrom::Start(off as u64)).unwrap();
        let mut buf = vec![0u8; n];
        f.read_exact(&mut buf).unwrap();
        assert!(buf == want[off..off + n], "bytes at {off}+{n} of {} differ", path.display());
    }
}

#[test]
#[ignore = "needs root, /dev/fuse and Ceph RGW: run by .ci/run"]
fn fuse_root_rgw_prefix_reads_equal_the_objects() {
    let rgw = Rgw::from_env();
    let prefix = unique_prefix("mnt");
    let objects = [
        ("train/shard-000.bin", 3_300_000),
        ("train/shard-001.bin", 1 << 20),
        ("train/deep/x/y.bin", 70_000),
        ("val/v.bin", 2_000_001),
        ("README", 12),
        ("empty", 0),
    ];
    let store = rgw.store();
    rt().block_on(upload(store.as_ref(), &prefix, &objects));
    let source = format!("s3://{}/{}", rgw.bucket, prefix.trim_end_matches('/'));
    let mut m = Mount::start(&source, &["--endpoint", &rgw.endpoint, "--region", "us-east-1"]);

    assert_eq!(names(&m.mnt), ["README", "empty", "train", "val"]);
    assert_eq!(names(&m.path("train")), ["deep", "shard-000.bin", "shard-001.bin"]);
    for (i, (name, len)) in objects.iter().enumerate() {
        let want = data(i as u64 + 1 + prefix.len() as u64, *len);
        let p = m.path(name);
        assert_eq!(std::fs::metadata(&p).unwrap().len(), *len as u64, "{name} size");
        assert_eq!(sha(&std::fs::read(&p).unwrap()), sha(&want), "{name} read through the mount differs");
        if *len > 0 {
            check_random_reads(&p, &want);
        }
    }
    let missing = std::fs::metadata(m.path("train/nope.bin")).unwrap_err();
    assert_eq!(missing.kind(), std::io::ErrorKind::NotFound);
    let err = std::fs::OpenOptions::new().write(true).open(m.path("README")).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(30), "writes are refused with EROFS in this read-only mount");
    m.stop();
}

#[test]
#[ignore = "needs root and /dev/fuse: run by .ci/run"]
fn fuse_root_sixteen_readers_of_one_and_many_files() {
    let src = tempfile::tempdir().unwrap();
    let files: Vec<(String, Vec<u8>)> =
        (0..8).map(|i| (format!("f{i}.bin"), data(100 + i, 2_500_000 + i as usize * 1000))).collect();
    for (n, d) in &files {
        std::fs::write(src.path().join(n), d).unwrap();
    }
    let mut m = Mount::start(src.path().to_str().unwrap(), &[]);
    std::thread::scope(|s| {
        for t in 0..16 {
            let (name, want) = if t < 8 { &files[0] } else { &files[t % 8] };
            let p = m.path(name);
            s.spawn(move || {
                let got = std::fs::read(&p).unwrap();
                assert!(got == *want, "reader {t} got wrong bytes from {name}");
            });
        }
    });
    m.stop();
}

#[test]
#[ignore = "needs root and /dev/fuse: run by .ci/run"]
fn fuse_root_sigkill_leaves_no_stale_mount() {
    let src = tempfile::tempdir().unwrap();
    std::fs::write(src.path().join("a"), b"abc").unwrap();
    let mut m = Mount::start(src.path().to_str().unwrap(), &[]);
    assert_eq!(std::fs::read(m.path("a")).unwrap(), b"abc");
    let mut c = m.child.take().unwrap();
    c.kill().unwrap();
    c.wait().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while mounted(&m.mnt) {
        assert!(Instant::now() < deadline, "a killed mount process left its mount behind");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
#[ignore = "needs Ceph RGW: run by .ci/run"]
fn fuse_root_bad_sources_fail_at_mount_time() {
    let rgw = Rgw::from_env();
    let dir = tempfile::tempdir().unwrap();
    let mnt = dir.path().join("mnt");
    std::fs::create_dir(&mnt).unwrap();
    let run = |args: &[&str]| {
        let out = Command::new(BIN)
            .arg("mount")
            .args(args)
            .arg(&mnt)
            .arg("--state-dir")
            .arg(dir.path().join("s"))
            .output()
            .unwrap();
        assert!(!out.status.success(), "mount {args:?} should fail");
        assert!(!mounted(&mnt));
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let err = run(&["s3://no-such-bucket-strata/x", "--endpoint", &rgw.endpoint]);
    assert!(err.contains("no-such-bucket-strata") && err.contains(&rgw.endpoint), "{err}");
    let err = Command::new(BIN)
        .args(["mount", &format!("s3://{}/x", rgw.bucket), "--endpoint", &rgw.endpoint])
        .arg(&mnt)
        .arg("--state-dir")
        .arg(dir.path().join("s"))
        .env("AWS_SECRET_ACCESS_KEY", "wrong-secret")
        .output()
        .unwrap();
    assert!(!err.status.success(), "wrong credentials must fail the mount");
    let text = String::from_utf8_lossy(&err.stderr);
    assert!(text.contains(&rgw.endpoint), "{text}");
    let err = run(&["/nonexistent/dataset"]);
    assert!(err.contains("/nonexistent/dataset") && err.contains("not a directory"), "{err}");
    let err = run(&["gs://bucket/x"]);
    assert!(err.contains("only s3://"), "{err}");
}
