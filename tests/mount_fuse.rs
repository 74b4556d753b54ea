//! End-to-end tests of `strata mount` through real FUSE mounts: of a bucket prefix on the Ceph
//! RGW that `.ci/run` starts, and of a local directory. They need root and /dev/fuse, so they
//! are ignored in a plain `cargo test` and run by `.ci/run`.

mod common;

use common::s3::*;
use common::*;
use object_store::ObjectStoreExt;
use std::io::{Read, Seek, SeekFrom};
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

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
    let mut rw = std::fs::OpenOptions::new().read(true).write(true).open(m.path("README")).unwrap();
    let mut back = Vec::new();
    rw.read_to_end(&mut back).unwrap();
    assert_eq!(back.len(), 12, "a read-write open reads the object");
    let err = std::io::Write::write_all(&mut rw, b"x").unwrap_err();
    assert_eq!(err.raw_os_error(), Some(1), "writing part of an existing object is refused with EPERM");
    // `rw` stays open across the SIGTERM below: the mount must still go away and the process
    // exit, after its bounded wait for open files.
    m.stop();
    drop(rw);
}

fn status_kib(pid: u32, field: &str) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = s.lines().find(|l| l.starts_with(field)).unwrap_or_else(|| panic!("no {field} in /proc/{pid}/status"));
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

/// Sixteen readers, half on one file and half on others, all sequential so read-ahead runs
/// flat out against RGW: every byte is right, and the mount's peak memory stays within its
/// memory budget (plus the kernel's in-flight FUSE requests and the process's own baseline).
#[test]
#[ignore = "needs root, /dev/fuse and Ceph RGW: run by .ci/run"]
fn fuse_root_rgw_sixteen_readers_stay_within_the_memory_budget() {
    let rgw = Rgw::from_env();
    let prefix = unique_prefix("rss");
    let objects: Vec<(String, usize)> = (0..9).map(|i| (format!("f{i}.bin"), 24 << 20)).collect();
    let refs: Vec<(&str, usize)> = objects.iter().map(|(n, l)| (n.as_str(), *l)).collect();
    rt().block_on(upload(rgw.store().as_ref(), &prefix, &refs));
    let source = format!("s3://{}/{}", rgw.bucket, prefix.trim_end_matches('/'));
    let budget_mib = 64;
    let mut m = Mount::start(
        &source,
        &["--endpoint", &rgw.endpoint, "--region", "us-east-1", "--memory-budget", &format!("{budget_mib}MiB")],
    );
    let pid = m.child.as_ref().unwrap().id();
    let _ = std::fs::read_dir(&m.mnt).unwrap().count();
    let baseline = status_kib(pid, "VmRSS:");
    std::thread::scope(|s| {
        for t in 0..16 {
            let i = if t < 8 { 0 } else { t - 7 };
            let want = data(i as u64 + 1 + prefix.len() as u64, 24 << 20);
            let p = m.path(&format!("f{i}.bin"));
            s.spawn(move || {
                let got = std::fs::read(&p).unwrap();
                assert!(got == want, "reader {t} got wrong bytes from f{i}.bin");
            });
        }
    });
    let peak = status_kib(pid, "VmHWM:");
    // The kernel keeps up to 64 FUSE requests of up to 1 MiB in flight (max_background).
    let allowed = baseline + (budget_mib + 64 + 32) * 1024;
    assert!(peak <= allowed, "peak RSS {peak} KiB above baseline {baseline} KiB + budget {budget_mib} MiB + slack");
    eprintln!("baseline {baseline} KiB, peak {peak} KiB, allowed {allowed} KiB");
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

/// A file opened again with `O_TRUNC` while another handle of it is open (the kernel sends no
/// truncate of its own for such an open): the object holds the new content alone, never the
/// new bytes over the old tail. And a script that writes one file twice in a row, the second
/// open racing the first close's release, leaves the second content.
#[test]
#[ignore = "needs root and /dev/fuse: run by .ci/run"]
fn fuse_root_an_o_trunc_open_beside_another_handle_rewrites_the_file_whole() {
    use std::io::Write;
    let src = tempfile::tempdir().unwrap();
    let mut m = Mount::start(src.path().to_str().unwrap(), &[]);
    let p = m.path("latest");
    let mut first = std::fs::File::create(&p).unwrap();
    first.write_all(b"step 1000 of the run").unwrap();
    first.sync_all().unwrap();
    let reader = std::fs::File::open(&p).unwrap();
    std::fs::write(&p, b"step 2000").unwrap();
    assert_eq!(std::fs::read(src.path().join("latest")).unwrap(), b"step 2000", "the store's object");
    drop(first);
    drop(reader);
    assert_eq!(std::fs::read(&p).unwrap(), b"step 2000", "read through the mount");
    assert_eq!(std::fs::read(src.path().join("latest")).unwrap(), b"step 2000", "after the last close");

    let script = "for i in $(seq 1 30); do echo \"a longer first line $i\" > status; echo \"s$i\" > status; done";
    let ok = Command::new("sh").arg("-c").arg(script).current_dir(&m.mnt).status().unwrap();
    assert!(ok.success());
    assert_eq!(std::fs::read_to_string(m.path("status")).unwrap(), "s30\n");
    m.stop();
    assert_eq!(std::fs::read_to_string(src.path().join("status")).unwrap(), "s30\n");
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

/// The race fusermount3's auto-unmount helper loses: it looks once, as soon as the dead
/// process's control socket closes, and a FUSE connection still held open at that moment
/// answers its look with ECONNABORTED, not ENOTCONN, so it leaves the mount. A dead process's
/// /dev/fuse descriptors can outlive its socket for a moment on a busy node; here another
/// process holds a copy (pidfd_getfd) until both the helper and Strata's guard wait on the
/// connection. The guard keeps asking, and detaches the mount once the connection is gone.
/// (The kernel does not always answer the helper that way, so without the guard this fails
/// often, not always.)
#[test]
#[ignore = "needs root, /dev/fuse and python3: run by .ci/run"]
fn fuse_root_a_mount_whose_connection_outlives_its_process_is_still_detached() {
    use std::io::{BufRead, BufReader};
    let src = tempfile::tempdir().unwrap();
    std::fs::write(src.path().join("a"), b"abc").unwrap();
    let mut m = Mount::start(src.path().to_str().unwrap(), &[]);
    assert_eq!(std::fs::read(m.path("a")).unwrap(), b"abc");
    let mut c = m.child.take().unwrap();
    // fusermount3's helper and Strata's guard, both children of the mount process.
    let out = Command::new("pgrep").args(["-P", &c.id().to_string()]).output().unwrap();
    let watchers: Vec<String> = String::from_utf8(out.stdout).unwrap().split_whitespace().map(String::from).collect();
    assert_eq!(watchers.len(), 2, "expected a fusermount3 helper and a guard: {watchers:?}");
    let fuse_fd = std::fs::read_dir(format!("/proc/{}/fd", c.id()))
        .unwrap()
        .filter_map(|e| e.ok())
        .find(|e| std::fs::read_link(e.path()).is_ok_and(|t| t == Path::new("/dev/fuse")))
        .expect("the mount process holds /dev/fuse")
        .file_name();
    const HOLD: &str = "import ctypes, os, sys\n\
        libc = ctypes.CDLL(None, use_errno=True)\n\
        fd = libc.syscall(438, os.pidfd_open(int(sys.argv[1])), int(sys.argv[2]), 0)\n\
        if fd < 0: sys.exit('pidfd_getfd: ' + os.strerror(ctypes.get_errno()))\n\
        print('held', flush=True)\n\
        sys.stdin.read()\n";
    let mut holder = Command::new("python3")
        .args(["-c", HOLD, &c.id().to_string(), &fuse_fd.to_string_lossy()])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(holder.stdout.take().unwrap()).read_line(&mut line).unwrap();
    assert_eq!(line, "held\n", "the holder did not get a copy of the mount's /dev/fuse");
    c.kill().unwrap();
    c.wait().unwrap();
    // Both look at the mount, and wait on the connection for an answer.
    let wchans = |pid: &String| -> Vec<String> {
        let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).into_iter().flatten().filter_map(|t| t.ok());
        tasks.filter_map(|t| std::fs::read_to_string(t.path().join("wchan")).ok()).collect()
    };
    let blocked = |pid: &String| wchans(pid).iter().any(|w| w == "request_wait_answer");
    let deadline = Instant::now() + Duration::from_secs(20);
    while !watchers.iter().all(blocked) {
        let now: Vec<Vec<String>> = watchers.iter().map(wchans).collect();
        assert!(
            Instant::now() < deadline,
            "the helper and the guard never looked at the dead mount (waiting in {now:?}):\n{}",
            m.log()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(mounted(&m.mnt), "the connection was held open, so the mount must still be there");
    drop(holder.stdin.take());
    holder.wait().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while mounted(&m.mnt) {
        assert!(Instant::now() < deadline, "the dead mount stayed once its connection was gone:\n{}", m.log());
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A dead mount nothing detached (its process, guard and fusermount3 helper all killed at
/// once, as a cgroup kill does) does not stop the next mount there: it is detached first.
#[test]
#[ignore = "needs root and /dev/fuse: run by .ci/run"]
fn fuse_root_a_dead_mount_left_at_the_mount_point_is_detached_by_the_next_mount() {
    let src = tempfile::tempdir().unwrap();
    std::fs::write(src.path().join("a"), b"abc").unwrap();
    let mut m = Mount::start(src.path().to_str().unwrap(), &[]);
    let mut c = m.child.take().unwrap();
    let helpers = Command::new("pkill").args(["-KILL", "-P", &c.id().to_string()]).status().unwrap();
    assert!(helpers.success(), "the mount process has no guard or fusermount3 helper to kill");
    c.kill().unwrap();
    c.wait().unwrap();
    std::thread::sleep(Duration::from_millis(500));
    let open = std::fs::File::open(&m.mnt).map(|_| ()).map_err(|e| e.raw_os_error());
    assert_eq!(open, Err(Some(107)), "the mount point should be a dead mount (ENOTCONN)");
    let dir = std::mem::replace(&mut m._dir, tempfile::tempdir().unwrap());
    let mut again = Mount::start_in(dir, src.path().to_str().unwrap(), &[]);
    // The dead mount is in /proc/mounts too, so wait for the new one to answer.
    let deadline = Instant::now() + Duration::from_secs(30);
    while std::fs::read(again.path("a")).ok().as_deref() != Some(b"abc".as_slice()) {
        assert!(Instant::now() < deadline, "the new mount never served the file:\n{}", again.log());
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(again.log().contains("detaching a dead mount"), "{}", again.log());
    again.stop();
}

#[test]
#[ignore = "needs Ceph RGW: run by .ci/run"]
fn fuse_root_bad_sources_fail_at_mount_time() {
    let rgw = Rgw::from_env();
    let dir = tempfile::tempdir().unwrap();
    let mnt = dir.path().join("mnt");
    std::fs::create_dir(&mnt).unwrap();
    // Every case must fail the mount, with its reason on stderr; `env` adjusts the process.
    let run_env = |args: &[&str], env: &dyn Fn(&mut Command)| {
        let mut cmd = Command::new(BIN);
        cmd.arg("mount").args(args).arg(&mnt).arg("--state-dir").arg(dir.path().join("s"));
        env(&mut cmd);
        let out = cmd.output().unwrap();
        assert!(!out.status.success(), "mount {args:?} should fail");
        assert!(!mounted(&mnt));
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let run = |args: &[&str]| run_env(args, &|_| {});
    let err = run(&["s3://no-such-bucket-strata/x", "--endpoint", &rgw.endpoint]);
    assert!(err.contains("no-such-bucket-strata") && err.contains(&rgw.endpoint), "{err}");
    let source = format!("s3://{}/x", rgw.bucket);
    let rgw_args = [source.as_str(), "--endpoint", &rgw.endpoint];
    // Wrong credentials.
    let text = run_env(&rgw_args, &|c| {
        c.env("AWS_SECRET_ACCESS_KEY", "wrong-secret");
    });
    assert!(text.contains(&rgw.endpoint), "{text}");
    // No credentials at all: a clear error, not a trip to the cloud's instance-metadata address.
    let text = run_env(&rgw_args, &|c| {
        c.env_remove("AWS_ACCESS_KEY_ID").env_remove("AWS_SECRET_ACCESS_KEY");
    });
    assert!(text.contains("no credentials") && text.contains("AWS_ACCESS_KEY_ID"), "{text}");
    // A node (or a minimal container image) without the system's CA certificates: the client
    // cannot be built even for plain HTTP, and the message says what to install.
    let text = run_env(&rgw_args, &|c| {
        c.env("SSL_CERT_FILE", dir.path().join("no-such-ca.pem")).env("SSL_CERT_DIR", dir.path().join("no-such-certs"));
    });
    assert!(text.contains("No CA certificates") && text.contains("ca-certificates"), "{text}");
    let err = run(&["/nonexistent/dataset"]);
    assert!(err.contains("/nonexistent/dataset") && err.contains("not a directory"), "{err}");
    let err = run(&["gs://bucket/x"]);
    assert!(err.contains("only s3://"), "{err}");
}

/// A standalone mount, with its own tiers, is watched and kept to its policy as the daemon's
/// cache is: its metrics endpoint counts what a read fetched and sent, and its policy runs in
/// the background (here, demoting an idle file to the warm tier, from which it still reads
/// whole). A policy file that is wrong, or a metrics port that is taken, fails the mount.
#[test]
#[ignore = "needs root, /dev/fuse and Ceph RGW: run by .ci/run"]
fn fuse_root_rgw_a_standalone_mount_serves_metrics_and_applies_its_policy() {
    let rgw = Rgw::from_env();
    let prefix = unique_prefix("standalone");
    let len = 3_000_000;
    rt().block_on(upload(rgw.store().as_ref(), &prefix, &[("data.bin", len)]));
    let want = data(1 + prefix.len() as u64, len);
    let source = format!("s3://{}/{}", rgw.bucket, prefix.trim_end_matches('/'));
    let dir = tempfile::tempdir().unwrap();
    let policy = dir.path().join("policy.toml");
    std::fs::write(&policy, "hot_idle = \"1s\"\n").unwrap();
    let addr = format!("127.0.0.1:{}", free_port());
    let policy_arg = policy.to_string_lossy().into_owned();
    let args = [
        "--endpoint",
        &rgw.endpoint,
        "--region",
        "us-east-1",
        "--warm-capacity",
        "64MiB",
        "--no-passthrough",
        "--metrics-listen",
        &addr,
        "--policy",
        &policy_arg,
        "--policy-interval",
        "1s",
    ];
    let mut m = Mount::start_in(dir, &source, &args);

    assert!(std::fs::read(m.path("data.bin")).unwrap() == want, "the first read differs from the object");
    let fetched = metric_at(&addr, "strata_cold_fetch_bytes_total");
    assert_eq!(fetched, len as u64, "the metrics should count the object's bytes fetched once");
    let gets = metric_at(&addr, "strata_object_requests_total{method=\"GET\",status=\"2xx\"}");
    assert!(gets >= 1, "no GET counted:\n{}", metrics_at(&addr));

    // The read's chunks reach the hot tier after the read returns (the tier write is off the
    // reader's path), so an empty hot tier alone may mean "not written yet": wait for the
    // demotion itself.
    let deadline = Instant::now() + Duration::from_secs(30);
    while metric_at(&addr, "strata_demotions_total") == 0 || metric_at(&addr, "strata_tier_chunks{tier=\"hot\"}") > 0 {
        assert!(
            Instant::now() < deadline,
            "the policy never demoted the idle file:\n{}\n{}",
            metrics_at(&addr),
            m.log()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    assert!(metric_at(&addr, "strata_tier_chunks{tier=\"warm\"}") > 0, "{}", metrics_at(&addr));
    // Dropped from the kernel's cache, the file is read again from the warm tier, not the store.
    Command::new("sh").args(["-c", "echo 3 > /proc/sys/vm/drop_caches"]).status().unwrap();
    assert!(std::fs::read(m.path("data.bin")).unwrap() == want, "the read from the warm tier differs");
    assert_eq!(metric_at(&addr, "strata_cold_fetch_bytes_total"), len as u64, "the second read went to the store");
    m.stop();

    // What must fail at start: a policy with a bad key's value, a port in use.
    let fails = |extra: &[&str]| {
        let dir = tempfile::tempdir().unwrap();
        let mnt = dir.path().join("mnt");
        std::fs::create_dir(&mnt).unwrap();
        let out = Command::new(BIN)
            .args(["mount", &source])
            .arg(&mnt)
            .arg("--state-dir")
            .arg(dir.path().join("state"))
            .args(["--endpoint", &rgw.endpoint, "--region", "us-east-1"])
            .args(extra)
            .output()
            .unwrap();
        assert!(!out.status.success(), "mount {extra:?} should fail");
        assert!(!mounted(&mnt), "a failed start left {} mounted", mnt.display());
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let bad = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(bad.path(), "hot_idle = \"soon\"\n").unwrap();
    let err = fails(&["--policy", &bad.path().to_string_lossy()]);
    assert!(err.contains("hot_idle") && err.contains(&*bad.path().to_string_lossy()), "{err}");
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let busy = taken.local_addr().unwrap().to_string();
    let err = fails(&["--metrics-listen", &busy]);
    assert!(err.contains(&busy) && err.contains("in use"), "{err}");
}

/// An on-premises Ceph serves HTTPS with a certificate signed by its own CA. Given that CA
/// (`--ca-file`), the mount reads and writes the bucket over TLS; without it, mounting fails at
/// once and says that the certificate is not trusted; a CA file that holds no certificate is
/// named.
#[test]
#[ignore = "needs root, /dev/fuse and Ceph RGW: run by .ci/run"]
fn fuse_root_rgw_over_https_with_the_clusters_own_ca() {
    use object_store::ObjectStoreExt;
    let rgw = Rgw::from_env();
    let var = |k: &str| std::env::var(k).unwrap_or_else(|_| panic!("{k} is not set: `bash .ci/run` sets it"));
    let (tls, ca) = (var("STRATA_TEST_S3_TLS_ENDPOINT"), var("STRATA_TEST_S3_CA"));
    let prefix = unique_prefix("tls");
    let body = data(0x715, 3 << 20);
    let loc = object_store::path::Path::from(format!("{prefix}x.bin"));
    rt().block_on(rgw.store().put(&loc, body.clone().into())).unwrap();
    let source = format!("s3://{}/{}", rgw.bucket, prefix.trim_end_matches('/'));

    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("mnt")).unwrap();
    let refused = |extra: &[&str]| {
        let out = Command::new(BIN)
            .args(["mount", &source])
            .arg(dir.path().join("mnt"))
            .arg("--state-dir")
            .arg(dir.path().join("s"))
            .args(["--endpoint", &tls, "--region", "us-east-1", "--timeout", "10s"])
            .args(extra)
            .output()
            .unwrap();
        assert!(!out.status.success(), "mount {extra:?} must fail");
        assert!(!mounted(&dir.path().join("mnt")));
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let err = refused(&[]);
    assert!(err.contains(&tls) && err.to_lowercase().contains("certificate"), "{err}");
    let err = refused(&["--ca-file", "/nonexistent/ca.pem"]);
    assert!(err.contains("cold.ca_file: cannot read /nonexistent/ca.pem"), "{err}");
    let not_pem = dir.path().join("not.pem");
    std::fs::write(&not_pem, "not a certificate").unwrap();
    let err = refused(&["--ca-file", not_pem.to_str().unwrap()]);
    assert!(err.contains("cold.ca_file") && err.contains("holds no PEM certificate"), "{err}");

    let args = ["--endpoint", &tls, "--region", "us-east-1", "--ca-file", &ca, "--part-size", "8MiB"];
    let mut m = Mount::start(&source, &args);
    assert!(std::fs::read(m.path("x.bin")).unwrap() == body, "the bytes read over TLS are the object's");
    // Writes over TLS leave the body out of the signature (`cold.sign_payload`): a checkpoint
    // in three parts, then renamed, arrives whole.
    let written = data(0x716, 20 << 20);
    std::fs::write(m.path("ck.tmp"), &written).unwrap();
    std::fs::rename(m.path("ck.tmp"), m.path("ck")).unwrap();
    m.stop();
    let ck = object_store::path::Path::from(format!("{prefix}ck"));
    let got = rt().block_on(async { rgw.store().get(&ck).await.unwrap().bytes().await.unwrap() });
    assert!(got == written, "the checkpoint written over TLS is whole in the store");
    delete_under(&rgw, &prefix);
}

const BLOCK: usize = 8 << 20;

fn block(i: usize) -> Vec<u8> {
    data(0xC0FFEE + i as u64, BLOCK)
}

/// The checkpoint pattern of PyTorch, DeepSpeed and Orbax: write a temp file, fsync, rename it
/// into place. 2 GiB through one mount; a second mount, standing in for another node, reads it
/// back identical.
#[test]
#[ignore = "needs root, /dev/fuse and Ceph RGW: run by .ci/run"]
fn fuse_root_rgw_checkpoint_round_trip_2gib() {
    use std::io::Write;
    let rgw = Rgw::from_env();
    let prefix = unique_prefix("ckpt");
    let blocks = (2usize << 30) / BLOCK;
    let mut a = rgw_mount(&rgw, &prefix);
    std::fs::create_dir(a.path("run1")).unwrap();
    let tmp = a.path("run1/model.pt.tmp");
    let mut f = std::fs::File::create(&tmp).unwrap();
    for i in 0..blocks {
        f.write_all(&block(i)).unwrap();
    }
    f.sync_all().expect("fsync returns once the upload is durable");
    assert_eq!(
        head(&rgw, &format!("{prefix}run1/model.pt.tmp")),
        Some((blocks * BLOCK) as u64),
        "fsync made it durable"
    );
    drop(f);
    std::fs::rename(&tmp, a.path("run1/model.pt")).unwrap();
    assert_eq!(head(&rgw, &format!("{prefix}run1/model.pt.tmp")), None);
    assert_eq!(head(&rgw, &format!("{prefix}run1/model.pt")), Some((blocks * BLOCK) as u64));

    let b = rgw_mount(&rgw, &prefix);
    let mut r = std::fs::File::open(b.path("run1/model.pt")).unwrap();
    let mut buf = vec![0u8; BLOCK];
    for i in 0..blocks {
        r.read_exact(&mut buf).unwrap();
        assert!(buf == block(i), "block {i} of the checkpoint differs on the second mount");
    }
    assert_eq!(r.read(&mut buf).unwrap(), 0, "no bytes past the end");
    a.stop();
    // The test RGW keeps objects in memory; give the space back.
    delete(&rgw, &format!("{prefix}run1/model.pt"));
}

fn etag(rgw: &Rgw, key: &str) -> String {
    use object_store::ObjectStoreExt;
    let meta = rt().block_on(rgw.store().head(&object_store::path::Path::from(key))).unwrap();
    meta.e_tag.unwrap_or_default()
}

/// S3 copies at most 5 GiB in one request, and a checkpoint is often larger. A proxy in front
/// of RGW answers single copies as S3 answers one over that limit (RGW itself copies any size
/// at once), and the mount's limit is lowered to 64 MiB so that a 200 MiB file stands in for a
/// large checkpoint: its rename is copied in parts, by RGW, and reads back identical. A file
/// under the limit whose copy is refused keeps its name, whole, and the rename fails with EIO.
/// Without the refusal, a file over the limit is still copied in one request.
#[test]
#[ignore = "needs root, /dev/fuse and Ceph RGW: run by .ci/run"]
fn fuse_root_rgw_rename_of_a_file_the_store_will_not_copy_at_once_is_copied_in_parts() {
    use common::faulty::{Fault, FaultyRegistry};
    use std::io::Write;
    let rgw = Rgw::from_env();
    let proxy = FaultyRegistry::start(rgw.endpoint.trim_start_matches("http://"));
    proxy.set(Fault::RefuseSingleCopies);
    let prefix = unique_prefix("partcopy");
    let source = format!("s3://{}/{}", rgw.bucket, prefix.trim_end_matches('/'));
    let endpoint = format!("http://{}", proxy.addr);
    let mut m =
        Mount::start(&source, &["--endpoint", &endpoint, "--region", "us-east-1", "--single-copy-limit", "64MiB"]);
    let key = |rel: &str| format!("{prefix}{rel}");

    let big = data(0x9A27, 200 << 20);
    let mut f = std::fs::File::create(m.path("model.pt.tmp")).unwrap();
    f.write_all(&big).unwrap();
    f.sync_all().unwrap();
    drop(f);
    std::fs::rename(m.path("model.pt.tmp"), m.path("model.pt")).expect("a refused copy over the limit goes in parts");
    assert_eq!(head(&rgw, &key("model.pt.tmp")), None, "the old name is gone");
    assert_eq!(sha(&get(&rgw, &key("model.pt"))), sha(&big), "the copy in RGW equals what was written");
    assert!(etag(&rgw, &key("model.pt")).trim_matches('"').ends_with("-4"), "four 64 MiB part copies");
    assert!(m.log().contains("copying it in parts"), "{}", m.log());
    let mut read = Vec::new();
    std::fs::File::open(m.path("model.pt")).unwrap().read_to_end(&mut read).unwrap();
    assert!(read == big, "the mount reads the renamed file back identical");

    std::fs::write(m.path("small.tmp"), b"under the limit").unwrap();
    let err = std::fs::rename(m.path("small.tmp"), m.path("small")).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(5), "a refused copy under the limit is EIO");
    assert_eq!(get(&rgw, &key("small.tmp")), b"under the limit", "the file keeps its name, whole");
    assert_eq!(head(&rgw, &key("small")), None);
    assert!(m.log().contains("InvalidRequest") || m.log().contains("copy source is larger"), "{}", m.log());

    proxy.set(Fault::None);
    let before = etag(&rgw, &key("model.pt"));
    std::fs::rename(m.path("model.pt"), m.path("model2.pt")).unwrap();
    assert_eq!(etag(&rgw, &key("model2.pt")), before, "a store that copies it at once gets one request");
    assert_eq!(m.log().matches("copying it in parts").count(), 1, "{}", m.log());
    m.stop();
    delete(&rgw, &key("model2.pt"));
    delete(&rgw, &key("small.tmp"));
}

/// Small-file write semantics through the mount, checked against what RGW holds.
#[test]
#[ignore = "needs root, /dev/fuse and Ceph RGW: run by .ci/run"]
fn fuse_root_rgw_write_semantics() {
    let rgw = Rgw::from_env();
    let prefix = unique_prefix("wsem");
    let mut m = rgw_mount(&rgw, &prefix);
    let key = |rel: &str| format!("{prefix}{rel}");

    std::fs::write(m.path("a.txt"), b"first").unwrap();
    assert_eq!(get(&rgw, &key("a.txt")), b"first", "close publishes the object");
    std::fs::write(m.path("a.txt"), b"second version").unwrap();
    assert_eq!(get(&rgw, &key("a.txt")), b"second version", "O_TRUNC rewrites it whole");
    assert_eq!(std::fs::read(m.path("a.txt")).unwrap(), b"second version");

    let errno = |r: std::io::Result<std::fs::File>| r.unwrap_err().raw_os_error();
    assert_eq!(errno(std::fs::OpenOptions::new().append(true).open(m.path("a.txt"))), Some(1), "append: EPERM");
    let mut inplace = std::fs::OpenOptions::new().write(true).open(m.path("a.txt")).unwrap();
    let err = std::io::Write::write_all(&mut inplace, b"x").unwrap_err();
    assert_eq!(err.raw_os_error(), Some(1), "in-place write: EPERM");
    drop(inplace);
    assert_eq!(
        std::fs::hard_link(m.path("a.txt"), m.path("b.txt")).unwrap_err().raw_os_error(),
        Some(1),
        "link: EPERM"
    );

    std::fs::File::create(m.path("empty")).unwrap();
    assert_eq!(head(&rgw, &key("empty")), Some(0), "an empty file is an empty object");

    std::fs::create_dir(m.path("d")).unwrap();
    std::fs::write(m.path("d/x"), b"x").unwrap();
    assert_eq!(
        std::fs::remove_dir(m.path("d")).unwrap_err().raw_os_error(),
        Some(39),
        "rmdir of a non-empty dir: ENOTEMPTY"
    );
    std::fs::remove_file(m.path("d/x")).unwrap();
    assert_eq!(head(&rgw, &key("d/x")), None, "unlink deletes the object");
    std::fs::remove_dir(m.path("d")).unwrap();
    assert!(!m.path("d").exists());

    std::fs::write(m.path("t.tmp"), b"payload").unwrap();
    std::fs::rename(m.path("t.tmp"), m.path("a.txt")).unwrap();
    assert_eq!(get(&rgw, &key("a.txt")), b"payload", "rename replaces the destination");
    assert_eq!(head(&rgw, &key("t.tmp")), None);
    assert_eq!(names(&m.mnt), ["a.txt", "empty"]);
    m.stop();
}

/// Names with characters that URIs and object_store's own paths escape are their keys,
/// exactly, both ways: an object uploaded by another client is read under its name, and a file
/// written through the mount lands under its name, not an escaped one.
#[test]
#[ignore = "needs root, /dev/fuse and Ceph RGW: run by .ci/run"]
fn fuse_root_rgw_names_with_uri_characters_are_their_keys() {
    let rgw = Rgw::from_env();
    let prefix = unique_prefix("odd-names");
    let theirs = "img[1] ~%41?#*.bin";
    let want = data(71, 300_000);
    rt().block_on(rgw.store().put(&at(&format!("{prefix}{theirs}")), want.clone().into())).unwrap();
    let mut m = rgw_mount(&rgw, &prefix);
    assert_eq!(names(&m.mnt), [theirs]);
    assert_eq!(std::fs::read(m.path(theirs)).unwrap(), want, "an object named with URI characters reads whole");

    let ours = "ckpt~1 [best] 100%.pt";
    std::fs::write(m.path(ours), b"weights").unwrap();
    let mut keys = keys_under(&rgw, &prefix);
    keys.sort();
    let mut expected = vec![format!("{prefix}{ours}"), format!("{prefix}{theirs}")];
    expected.sort();
    assert_eq!(keys, expected, "a file written through the mount is the object of its own name");
    assert_eq!(get(&rgw, &format!("{prefix}{ours}")), b"weights");
    std::fs::rename(m.path(ours), m.path("renamed ~ok~.pt")).unwrap();
    assert_eq!(get(&rgw, &format!("{prefix}renamed ~ok~.pt")), b"weights");
    assert_eq!(head(&rgw, &format!("{prefix}{ours}")), None, "the rename took the object from its old name");
    m.stop();
    delete_under(&rgw, &prefix);
}

/// The unfinished multipart uploads RGW holds for `key`, as S3's ListMultipartUploads gives
/// them (object_store has no call for it; curl signs the request).
fn unfinished_uploads(rgw: &Rgw, key: &str) -> usize {
    let out = Command::new("curl")
        .args(["-sS", "--fail-with-body", "--aws-sigv4", "aws:amz:us-east-1:s3", "--user"])
        .arg(format!("{}:{}", rgw.access_key, rgw.secret_key))
        .args(["-H", "x-amz-content-sha256: UNSIGNED-PAYLOAD"])
        // SigV4 wants the query sorted and encoded as curl does not do it itself.
        .arg(format!("{}/{}/?prefix={}&uploads=", rgw.endpoint, rgw.bucket, key.replace('/', "%2F")))
        .output()
        .unwrap();
    let body = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success() && body.contains("<ListMultipartUploadsResult"), "listing uploads failed: {body}");
    body.matches("<UploadId>").count()
}

/// A writer cut off by a crash mid-write leaves no object, and the parts that went up while it
/// wrote do not stay in the store either: the next start aborts that upload.
#[test]
#[ignore = "needs root, /dev/fuse and Ceph RGW: run by .ci/run"]
fn fuse_root_rgw_a_crash_mid_write_leaves_no_parts_in_the_store() {
    use std::io::Write;
    let rgw = Rgw::from_env();
    let prefix = unique_prefix("cutparts");
    let source = format!("s3://{}/{}", rgw.bucket, prefix.trim_end_matches('/'));
    let args = ["--endpoint", rgw.endpoint.as_str(), "--region", "us-east-1", "--part-size", "5MiB"];
    let mut m = Mount::start_in(tempfile::tempdir().unwrap(), &source, &args);
    let key = format!("{prefix}cut.pt");
    let mut f = std::fs::File::create(m.path("cut.pt")).unwrap();
    f.write_all(&data(0xC07, 12 << 20)).unwrap();
    // No child process while the file is open: its exec would close a copy of the descriptor,
    // and that close is a flush, which publishes the file.
    let staging = m._dir.path().join("state/staging");
    let started = || {
        std::fs::read_dir(&staging).unwrap().flatten().any(|e| {
            e.path().extension().is_some_and(|x| x == "json")
                && std::fs::read_to_string(e.path()).is_ok_and(|t| t.contains("\"upload\":"))
        })
    };
    wait_until(Duration::from_secs(30), started);
    assert!(started(), "parts go up while the file is written:\n{}", m.log());
    let mut c = m.child.take().unwrap();
    c.kill().unwrap();
    c.wait().unwrap();
    drop(f);
    assert_eq!(head(&rgw, &key), None, "a crash mid-write left an object behind");
    assert_eq!(unfinished_uploads(&rgw, &key), 1, "the killed process could not abort its upload");
    wait_until(Duration::from_secs(60), || !mounted(&m.mnt));
    assert!(!mounted(&m.mnt), "the killed mount was never unmounted");
    let dir = std::mem::replace(&mut m._dir, tempfile::tempdir().unwrap());
    let mut again = Mount::start_in(dir, &source, &args);
    wait_until(Duration::from_secs(10), || unfinished_uploads(&rgw, &key) == 0);
    assert_eq!(unfinished_uploads(&rgw, &key), 0, "the restart left the parts in the store:\n{}", again.log());
    assert!(again.log().contains("cut.pt: left incomplete"), "{}", again.log());
    assert_eq!(head(&rgw, &key), None, "the restart uploaded a cut-off file");
    again.stop();
}

/// SIGKILL while a finished file is being uploaded: the object is absent or whole, never torn,
/// and the next start uploads the staged copy and aborts the killed upload.
#[test]
#[ignore = "needs root, /dev/fuse and Ceph RGW: run by .ci/run"]
fn fuse_root_rgw_sigkill_mid_upload_leaves_no_torn_object() {
    use std::io::Write;
    let rgw = Rgw::from_env();
    let prefix = unique_prefix("kill");
    let source = format!("s3://{}/{}", rgw.bucket, prefix.trim_end_matches('/'));
    let state = tempfile::tempdir().unwrap();
    let state_path = state.path().to_path_buf();
    let args =
        ["--endpoint", rgw.endpoint.as_str(), "--region", "us-east-1", "--part-size", "8MiB", "--upload-parallel", "1"];
    let mut m = Mount::start_in(state, &source, &args);
    let blocks = 40; // 320 MiB: a multipart upload of 40 parts, slow enough to interrupt
    let target = m.path("big.bin");
    let writer = std::thread::spawn(move || {
        use std::io::{Seek, SeekFrom};
        let mut f = std::fs::File::create(&target).unwrap();
        // The first part goes up as soon as it is written; writing it again gives that
        // upload-while-writing up, so the whole file goes up at fsync, after its manifest is
        // marked complete: the window this test kills in. (A streamed file is complete only
        // for the moment its last part takes.)
        f.write_all(&block(0)).unwrap();
        f.seek(SeekFrom::Start(0)).unwrap();
        f.write_all(&block(0)).unwrap();
        for i in 1..blocks {
            f.write_all(&block(i)).unwrap();
        }
        let _ = f.sync_all();
    });
    // The manifest turns complete right before the whole-file upload starts.
    let staging = state_path.join("state/staging");
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let complete = std::fs::read_dir(&staging)
            .map(|rd| {
                rd.filter_map(|e| e.ok())
                    .any(|e| std::fs::read_to_string(e.path()).is_ok_and(|t| t.contains("\"complete\":true")))
            })
            .unwrap_or(false);
        if complete {
            break;
        }
        assert!(Instant::now() < deadline, "the upload never started:\n{}", m.log());
        std::thread::sleep(Duration::from_millis(5));
    }
    std::thread::sleep(Duration::from_millis(200));
    let mut c = m.child.take().unwrap();
    c.kill().unwrap();
    c.wait().unwrap();
    let _ = writer.join();
    let key = format!("{prefix}big.bin");
    let whole = (blocks * BLOCK) as u64;
    match head(&rgw, &key) {
        None => {}
        Some(n) => assert_eq!(n, whole, "a torn object is visible after SIGKILL"),
    }
    // Wait for the auto-unmount, then start again on the same state: the staged copy goes up.
    // Generous: under a loaded CI machine fusermount's auto-unmount can take seconds.
    let deadline = Instant::now() + Duration::from_secs(60);
    while mounted(&m.mnt) {
        if Instant::now() >= deadline {
            // What is left of the auto-unmount helper, for the report. (Nothing here touches the
            // mount itself: on a dead FUSE mount that could hang.)
            let helpers = std::process::Command::new("pgrep").args(["-a", "fusermount"]).output().unwrap();
            panic!(
                "the killed mount was never unmounted; fusermount processes: {:?}\n{}",
                String::from_utf8_lossy(&helpers.stdout),
                m.log()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let dir = std::mem::replace(&mut m._dir, tempfile::tempdir().unwrap());
    let mut again = Mount::start_in(dir, &source, &args);
    assert_eq!(head(&rgw, &key), Some(whole), "the restart did not upload the staged checkpoint:\n{}", again.log());
    let got = get(&rgw, &key);
    for i in 0..blocks {
        assert!(got[i * BLOCK..(i + 1) * BLOCK] == block(i), "block {i} of the re-uploaded object differs");
    }
    assert_eq!(unfinished_uploads(&rgw, &key), 0, "the killed upload's parts are still in the store:\n{}", again.log());
    again.stop();
    delete(&rgw, &key);
}

/// An upload that fails is an error from fsync and from close, never silent. The store here is
/// a local directory made immutable (`chattr +i`), which refuses every new object even to root.
#[test]
#[ignore = "needs root, /dev/fuse and chattr on ext4: run by .ci/run"]
fn fuse_root_failed_upload_is_an_error_from_fsync_and_close() {
    use std::io::Write;
    let src = tempfile::tempdir().unwrap();
    std::fs::create_dir(src.path().join("locked")).unwrap();
    let lock = |flag: &str| {
        let ok = Command::new("chattr").arg(flag).arg(src.path().join("locked")).status().unwrap().success();
        assert!(ok, "chattr {flag} failed");
    };
    lock("+i");
    let mut m = Mount::start(src.path().to_str().unwrap(), &[]);
    let mut f = std::fs::File::create(m.path("locked/x")).unwrap();
    f.write_all(b"cannot land").unwrap();
    let err = f.sync_all().unwrap_err();
    assert_eq!(err.raw_os_error(), Some(5), "fsync must report the failed upload as EIO");
    drop(f);
    // std's File ignores close(2)'s result; dd checks it and says so.
    let out = Command::new("dd")
        .args(["if=/dev/zero", "bs=1k", "count=3", "status=none"])
        .arg(format!("of={}", m.path("locked/y").display()))
        .output()
        .unwrap();
    assert!(!out.status.success(), "close must fail when the upload fails");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("closing") && err.contains("Input/output error"), "{err}");
    lock("-i");
    // The kernel's release comes after close returned; it must not upload either file now that
    // the store would take them.
    wait_until(Duration::from_secs(10), || m.log().matches("not uploaded at release").count() >= 2);
    std::thread::sleep(Duration::from_millis(300));
    assert!(!src.path().join("locked/x").exists() && !src.path().join("locked/y").exists());
    assert!(m.log().contains("uploading locked/x failed"), "{}", m.log());
    assert_eq!(m.log().matches("not uploaded at release").count(), 2, "{}", m.log());
    m.stop();
}

/// Over a local directory, the embedded default store, fsync returns once the object is on
/// disk, not in the page cache: no page of it is left dirty, whether it went up in one write or
/// in parts.
#[test]
#[ignore = "needs root, /dev/fuse and Linux 6.5 or later: run by .ci/run"]
fn fuse_root_fsync_over_a_local_store_leaves_the_object_on_disk() {
    use std::io::Write;
    let src = tempfile::tempdir().unwrap();
    let mut m = Mount::start(src.path().to_str().unwrap(), &["--part-size", "8MiB"]);
    for (name, len) in [("small.pt", 300 << 10), ("large.pt", 20 << 20)] {
        let body = data(len as u64, len);
        let mut f = std::fs::File::create(m.path(name)).unwrap();
        f.write_all(&body).unwrap();
        f.sync_all().unwrap();
        let object = src.path().join(name);
        assert_eq!(std::fs::read(&object).unwrap().len(), len, "{name} is whole in the store");
        let (cached, unwritten) = page_cache_state(&object);
        assert!(cached > 0, "{name}: the check must see the object's pages to mean anything");
        assert_eq!(unwritten, 0, "{name}: {unwritten} of its {cached} cached pages were not yet on disk");
        drop(f);
    }
    m.stop();
}

/// A temporary file: created, unlinked, then used through its descriptor, as `tmpfile()` and
/// many tools do. The kernel asks for its attributes again after writes and before reads past
/// the size it knew; those must not fail because the name is gone.
#[test]
#[ignore = "needs root and /dev/fuse: run by .ci/run"]
fn fuse_root_an_unlinked_file_is_still_whole_through_its_descriptor() {
    use std::io::Write;
    let src = tempfile::tempdir().unwrap();
    let mut m = Mount::start(src.path().to_str().unwrap(), &[]);
    let mut f =
        std::fs::OpenOptions::new().create(true).truncate(true).read(true).write(true).open(m.path("scratch")).unwrap();
    f.write_all(b"before the unlink, ").unwrap();
    std::fs::remove_file(m.path("scratch")).unwrap();
    assert!(!m.path("scratch").exists());
    f.write_all(b"and after it").unwrap();
    assert_eq!(f.metadata().unwrap().len(), 31, "fstat of the open file");
    assert_eq!(f.seek(SeekFrom::End(0)).unwrap(), 31);
    f.seek(SeekFrom::Start(0)).unwrap();
    let mut back = String::new();
    f.read_to_string(&mut back).unwrap();
    assert_eq!(back, "before the unlink, and after it");
    drop(f);
    assert!(std::fs::read_dir(src.path()).unwrap().next().is_none(), "nothing went to the store");
    m.stop();
}

/// A process forked while a checkpoint is being written closes its copy of the descriptor at
/// its exec or its exit, and the kernel sends each close as a flush. Those flushes must not
/// publish the half-written file: only the writer's own close does.
#[test]
#[ignore = "needs root and /dev/fuse: run by .ci/run"]
fn fuse_root_a_childs_close_of_an_inherited_descriptor_publishes_nothing() {
    use std::io::Write;
    let src = tempfile::tempdir().unwrap();
    let mut m = Mount::start(src.path().to_str().unwrap(), &[]);
    let whole = data(0xF0, 6 << 20);
    let mut f = std::fs::File::create(m.path("ckpt.pt")).unwrap();
    f.write_all(&whole[..2 << 20]).unwrap();
    // std opens files with O_CLOEXEC: the child's exec closes its copy.
    assert!(Command::new("true").status().unwrap().success());
    assert!(!src.path().join("ckpt.pt").exists(), "a child's exec published the half-written file");
    f.write_all(&whole[2 << 20..4 << 20]).unwrap();
    // A child that gets the descriptor as its stdout and closes it when it exits. The command
    // keeps the parent's copy until it is dropped: closing that copy would be a close by the
    // writer's own process, which publishes.
    let mut child = Command::new("sleep");
    child.arg("0.1").stdout(f.try_clone().unwrap());
    assert!(child.status().unwrap().success());
    assert!(!src.path().join("ckpt.pt").exists(), "a child's exit published the half-written file");
    f.write_all(&whole[4 << 20..]).unwrap();
    drop(child);
    drop(f);
    assert!(std::fs::read(src.path().join("ckpt.pt")).unwrap() == whole, "the writer's close publishes it whole");
    m.stop();
}

/// Unmounts a tmpfs on drop, first of all, so a failing test leaves none behind.
struct Tmpfs(std::path::PathBuf);

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

#[test]
#[ignore = "needs root (tmpfs, /dev/fuse): run by .ci/run"]
fn fuse_root_a_full_staging_disk_is_enospc_to_the_writer() {
    let src = tempfile::tempdir().unwrap();
    let dir = tempfile::tempdir().unwrap();
    // The staging dir on a disk of 1 MiB; the hot tier and the rest of the state elsewhere.
    let staging = dir.path().join("state/staging");
    std::fs::create_dir_all(&staging).unwrap();
    let ok = Command::new("mount").args(["-t", "tmpfs", "-o", "size=1m", "tmpfs"]).arg(&staging).status().unwrap();
    assert!(ok.success(), "mounting a tmpfs needs root");
    let tmpfs = Tmpfs(staging);
    let mut m = Mount::start_in(dir, src.path().to_str().unwrap(), &[]);
    let out = Command::new("dd")
        .args(["if=/dev/zero", "bs=64k", "count=64", "status=none"])
        .arg(format!("of={}", m.path("ckpt.bin").display()))
        .output()
        .unwrap();
    assert!(!out.status.success(), "4 MiB cannot be staged on 1 MiB");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("No space left on device"), "the writer is told the disk is full: {err}");
    assert!(!err.contains("Input/output error"), "{err}");
    assert!(m.log().contains("the staging disk is full"), "{}", m.log());
    // The file had a hole its writer was told of: close did not upload the part that fitted,
    // and the release after it dropped the staged bytes, giving the space back.
    wait_until(Duration::from_secs(10), || m.log().contains("not uploaded: a write to it failed"));
    // dd closes its first descriptor of the file before writing (it writes through a copy),
    // which publishes the file as it was then: empty. No byte of the refused content follows.
    let size = |p: std::path::PathBuf| std::fs::metadata(p).map(|m| m.len()).unwrap_or(0);
    assert_eq!(size(src.path().join("ckpt.bin")), 0, "no byte of the failed write reached the store\n{}", m.log());
    // The kernel asks again for the size its writes had raised.
    wait_until(Duration::from_secs(5), || size(m.path("ckpt.bin")) == 0);
    assert_eq!(size(m.path("ckpt.bin")), 0, "the mount shows what the store holds");
    let staged = std::fs::read_dir(&tmpfs.0)
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.path().extension().is_some_and(|x| x == "data") && e.metadata().is_ok_and(|m| m.len() > 0));
    assert_eq!(staged.count(), 0, "the staged bytes are gone");
    // A writer that truncates to zero after the error starts the file again, and what it
    // writes then goes up as usual.
    {
        use std::io::Write;
        let mut f = std::fs::File::create(m.path("again.bin")).unwrap();
        let err = f.write_all(&vec![1u8; 4 << 20]).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(28), "ENOSPC: {err}");
        assert_eq!(f.sync_all().unwrap_err().raw_os_error(), Some(28), "fsync says so again");
        f.set_len(0).unwrap();
        f.write_all(b"fits").unwrap();
        f.sync_all().unwrap();
    }
    assert_eq!(std::fs::read(src.path().join("again.bin")).unwrap(), b"fits");
    // With the space back, a file that fits goes up whole.
    std::fs::write(m.path("small.bin"), vec![7u8; 64 << 10]).unwrap();
    assert_eq!(std::fs::read(src.path().join("small.bin")).unwrap(), vec![7u8; 64 << 10]);
    m.stop();
    // Before the state dir goes with `m`, so that it can.
    drop(tmpfs);
}

/// A mount declared in the daemon's config reads through the daemon's own cache, so
/// `strata tier` warms, shows and evicts what the mount serves, and the writes it takes land in
/// the cold store under the mount's prefix.
#[test]
#[ignore = "needs root and /dev/fuse: run by .ci/run"]
fn fuse_root_daemon_mounts_share_the_cache_with_tier() {
    let cold = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(cold.path().join("ds/sub")).unwrap();
    let a = data(7, 3_000_000);
    std::fs::write(cold.path().join("ds/a.bin"), &a).unwrap();
    std::fs::write(cold.path().join("ds/sub/b.txt"), b"bee").unwrap();
    std::fs::write(cold.path().join("elsewhere.bin"), b"not in the mount").unwrap();
    let mnt = tempfile::tempdir().unwrap();
    let body = format!(
        "[cold]\nkind = \"local\"\npath = \"{}\"\n[[mounts]]\npath = \"{}\"\nprefix = \"ds\"\n",
        cold.path().display(),
        mnt.path().display()
    );
    let mut d = Daemon::start(&body, "64MiB", "64MiB");
    assert!(mounted(mnt.path()), "the daemon did not mount its dataset:\n{}", d.log());
    assert_eq!(names(mnt.path()), ["a.bin", "sub"]);

    let out = d.tier_ok(&["warmup", "ds/"]);
    assert!(out.contains("2 objects, 4/4 chunks"), "{out}");
    assert_eq!(std::fs::read(mnt.path().join("a.bin")).unwrap(), a);
    assert_eq!(std::fs::read(mnt.path().join("sub/b.txt")).unwrap(), b"bee");
    let s = d.status();
    assert_eq!(s["cold_fetches"], 4, "reads through the mount were served by the daemon's warmed cache");
    assert!(tier(&s, "hot")["hits"].as_u64().unwrap() >= 4);

    std::fs::write(mnt.path().join("new.txt"), b"written through the mount").unwrap();
    assert_eq!(std::fs::read(cold.path().join("ds/new.txt")).unwrap(), b"written through the mount");
    d.stop();
    assert!(!mounted(mnt.path()), "the daemon left its mount behind on SIGTERM");
}

/// A daemon stops within the time systemd or kubelet gives it even when every one of its
/// mounts has a file held open, by a process that keeps the mount alive after it is detached
/// (a pod without mount propagation does that): the mounts are let go all at once, each
/// waiting its 10 s for the open files, not one after another.
#[test]
#[ignore = "needs root and /dev/fuse: run by .ci/run"]
fn fuse_root_a_daemon_with_busy_mounts_stops_in_one_wait_not_one_per_mount() {
    let cold = tempfile::tempdir().unwrap();
    let mnts: Vec<tempfile::TempDir> = (0..3).map(|_| tempfile::tempdir().unwrap()).collect();
    let mut body = format!("[cold]\nkind = \"local\"\npath = \"{}\"\n", cold.path().display());
    for (i, m) in mnts.iter().enumerate() {
        std::fs::create_dir_all(cold.path().join(format!("p{i}"))).unwrap();
        std::fs::write(cold.path().join(format!("p{i}/held")), b"held open").unwrap();
        body += &format!("[[mounts]]\npath = \"{}\"\nprefix = \"p{i}\"\n", m.path().display());
    }
    let mut d = Daemon::start(&body, "64MiB", "64MiB");
    let held: Vec<std::fs::File> = mnts.iter().map(|m| std::fs::File::open(m.path().join("held")).unwrap()).collect();
    let started = Instant::now();
    // Daemon::stop fails the test if the daemon is still there 20 s after SIGTERM; one 10 s
    // wait per mount would take 30.
    d.stop();
    let took = started.elapsed();
    let log = d.log();
    assert_eq!(log.matches("files are still open on the detached mount").count(), 3, "{log}");
    assert!(mnts.iter().all(|m| !mounted(m.path())), "{log}");
    drop(held);
    assert!(took < Duration::from_secs(20), "stopping took {took:?}");
}

/// A daemon mount killed while a file is being written keeps that file staged as its own:
/// after a restart whose config lists the mounts in another order, the leftover is reported by
/// the mount it was written through, not by whichever mount took that place in the list.
#[test]
#[ignore = "needs root and /dev/fuse: run by .ci/run"]
fn fuse_root_daemon_mounts_keep_their_leftovers_when_the_config_is_reordered() {
    use std::io::Write;
    let cold = tempfile::tempdir().unwrap();
    for p in ["a", "b"] {
        std::fs::create_dir_all(cold.path().join(p)).unwrap();
        std::fs::write(cold.path().join(p).join("seed"), p).unwrap();
    }
    let (ma, mb) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let mount = |m: &tempfile::TempDir, prefix: &str| {
        format!("[[mounts]]\npath = \"{}\"\nprefix = \"{prefix}\"\n", m.path().display())
    };
    let cold_toml = format!("[cold]\nkind = \"local\"\npath = \"{}\"\n", cold.path().display());
    let mut d = Daemon::start(&format!("{cold_toml}{}{}", mount(&ma, "a"), mount(&mb, "b")), "64MiB", "64MiB");
    assert!(mounted(ma.path()) && mounted(mb.path()), "{}", d.log());
    let mut f = std::fs::File::create(mb.path().join("ck.pt")).unwrap();
    f.write_all(&data(5, 1 << 20)).unwrap();
    // Killed mid-write, with the file open: no child process meanwhile, whose exec would flush it.
    d.kill9();
    drop(f);
    wait_until(Duration::from_secs(60), || !mounted(ma.path()) && !mounted(mb.path()));

    let text = std::fs::read_to_string(&d.config).unwrap();
    let reordered =
        text.replace(&mount(&ma, "a"), "").replace(&mount(&mb, "b"), "") + &mount(&mb, "b") + &mount(&ma, "a");
    std::fs::write(&d.config, reordered).unwrap();
    d.spawn();
    let log = d.log();
    let reported: Vec<&str> = log.lines().filter(|l| l.contains("ck.pt: left incomplete")).collect();
    assert_eq!(reported.len(), 1, "{log}");
    assert!(
        reported[0].contains(&mb.path().display().to_string()),
        "reported by the mount it was written through: {}",
        reported[0]
    );
    assert!(!cold.path().join("a/ck.pt").exists() && !cold.path().join("b/ck.pt").exists());
    d.stop();
}

fn fio(dir: &Path, args: &[&str]) {
    let out = Command::new("fio")
        .current_dir(dir)
        // create_on_open: no separate lay-out pass that writes, closes and reopens the file.
        .args(["--ioengine=psync", "--fallocate=none", "--verify=crc32c", "--verify_state_save=0", "--size=64M"])
        .arg("--create_on_open=1")
        .args(args)
        .output()
        .expect("fio runs (package fio)");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.contains("err= 0"),
        "fio {args:?} failed:\n{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// fio sequential and random jobs write through one mount with verification, then a second
/// mount (another node, cold cache) verifies every block it reads back from RGW.
#[test]
#[ignore = "needs root, /dev/fuse, fio and Ceph RGW: run by .ci/run"]
fn fuse_root_rgw_fio_jobs_verify() {
    let rgw = Rgw::from_env();
    let prefix = unique_prefix("fio");
    let seq = ["--name=seq", "--filename=seq.dat", "--rw=write", "--bs=1M"];
    let rand = ["--name=rand", "--filename=rand.dat", "--rw=randwrite", "--bs=256k", "--randrepeat=1"];
    let mut a = rgw_mount(&rgw, &prefix);
    fio(&a.mnt, &seq);
    fio(&a.mnt, &rand);
    a.stop();
    let mut b = rgw_mount(&rgw, &prefix);
    // Read jobs check every block against the header and CRC the write jobs put in it.
    fio(&b.mnt, &["--name=seqread", "--filename=seq.dat", "--rw=read", "--bs=1M", "--readonly"]);
    fio(&b.mnt, &["--name=randread", "--filename=rand.dat", "--rw=randread", "--bs=256k", "--readonly"]);
    b.stop();
    delete(&rgw, &format!("{prefix}seq.dat"));
    delete(&rgw, &format!("{prefix}rand.dat"));
}

/// A prefix of 100,000 objects lists completely through the mount: every name, once.
#[test]
#[ignore = "needs root, /dev/fuse and Ceph RGW: run by .ci/run"]
fn fuse_root_rgw_readdir_of_100k_objects() {
    use futures::StreamExt;
    use object_store::ObjectStoreExt;
    const N: usize = 100_000;
    let rgw = Rgw::from_env();
    let prefix = unique_prefix("big-dir");
    let store = rgw.store();
    rt().block_on(async {
        futures::stream::iter(0..N)
            .map(|i| {
                let (store, key) = (store.clone(), format!("{prefix}d/f{i:06}"));
                async move { store.put(&object_store::path::Path::from(key), bytes::Bytes::from_static(b"x").into()).await }
            })
            .buffer_unordered(64)
            .for_each(|r| async move {
                r.expect("upload to RGW");
            })
            .await;
    });
    let mut m = rgw_mount(&rgw, &prefix);
    let listed = names(&m.path("d"));
    assert_eq!(listed.len(), N);
    assert_eq!(listed.first().map(String::as_str), Some("f000000"));
    assert_eq!(listed.last().map(String::as_str), Some("f099999"));
    assert!(listed.windows(2).all(|w| w[0] < w[1]), "a name is listed twice");
    assert_eq!(std::fs::read(m.path("d/f054321")).unwrap(), b"x");
    m.stop();
}

/// A TCP relay to RGW that the test can cut, standing in for an RGW outage.
struct Relay {
    port: u16,
    down: std::sync::Arc<std::sync::atomic::AtomicBool>,
    live: std::sync::Arc<std::sync::Mutex<Vec<std::net::TcpStream>>>,
}

impl Relay {
    fn to(upstream: &str) -> Relay {
        use std::sync::atomic::Ordering;
        let upstream = upstream.trim_start_matches("http://").to_string();
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let down = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let live = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let (d, l) = (down.clone(), live.clone());
        std::thread::spawn(move || {
            for client in listener.incoming().take(10_000) {
                let Ok(client) = client else { continue };
                if d.load(Ordering::SeqCst) {
                    continue; // dropped: the store is "gone"
                }
                let Ok(server) = std::net::TcpStream::connect(&upstream) else { continue };
                l.lock().unwrap().extend([client.try_clone().unwrap(), server.try_clone().unwrap()]);
                for (mut from, mut to) in [(client.try_clone().unwrap(), server.try_clone().unwrap()), (server, client)]
                {
                    std::thread::spawn(move || {
                        let _ = std::io::copy(&mut from, &mut to);
                        let _ = to.shutdown(std::net::Shutdown::Both);
                    });
                }
            }
        });
        Relay { port, down, live }
    }

    fn cut(&self) {
        self.down.store(true, std::sync::atomic::Ordering::SeqCst);
        for s in self.live.lock().unwrap().drain(..) {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
    }

    fn restore(&self) {
        self.down.store(false, std::sync::atomic::Ordering::SeqCst);
    }
}

/// RGW goes away in the middle of a read: the read fails with EIO within the configured
/// timeout, never with wrong bytes, and reads work again once RGW is back.
#[test]
#[ignore = "needs root, /dev/fuse and Ceph RGW: run by .ci/run"]
fn fuse_root_rgw_outage_mid_read_is_eio_then_recovers() {
    let rgw = Rgw::from_env();
    let prefix = unique_prefix("outage");
    let len = 32 << 20;
    rt().block_on(upload(rgw.store().as_ref(), &prefix, &[("big.bin", len)]));
    let want = data(1 + prefix.len() as u64, len);
    let relay = Relay::to(&rgw.endpoint);
    let endpoint = format!("http://127.0.0.1:{}", relay.port);
    let source = format!("s3://{}/{}", rgw.bucket, prefix.trim_end_matches('/'));
    let mut m =
        Mount::start(&source, &["--endpoint", &endpoint, "--region", "us-east-1", "--timeout", "3s", "--retries", "1"]);
    let mut f = std::fs::File::open(m.path("big.bin")).unwrap();
    let mut head = vec![0u8; 1 << 20];
    f.read_exact(&mut head).unwrap();
    assert!(head == want[..1 << 20]);

    relay.cut();
    let started = Instant::now();
    let mut rest = Vec::new();
    let err = f.read_to_end(&mut rest).expect_err("reads of uncached chunks must fail while RGW is gone");
    assert_eq!(err.raw_os_error(), Some(5), "expected EIO, got {err}");
    assert!(started.elapsed() < Duration::from_secs(3 + 10), "waited {:?} past the 3s timeout", started.elapsed());
    // Whatever did arrive before the error is right.
    let got = (1 << 20) + rest.len();
    assert!(rest[..] == want[1 << 20..got], "bytes served during the outage differ");

    relay.restore();
    drop(f);
    assert_eq!(sha(&std::fs::read(m.path("big.bin")).unwrap()), sha(&want), "reads resume once RGW is back");
    m.stop();
}

/// The hot tier's disk is full (a 1 MiB tmpfs under a 64 MiB capacity): reads through the mount
/// go on, from the warm tier and RGW, with the right bytes.
#[test]
#[ignore = "needs root (tmpfs, /dev/fuse) and Ceph RGW: run by .ci/run"]
fn fuse_root_rgw_full_hot_disk_reads_go_on() {
    let rgw = Rgw::from_env();
    let prefix = unique_prefix("mnt-enospc");
    let len = 6_000_000;
    rt().block_on(upload(rgw.store().as_ref(), &prefix, &[("big.bin", len)]));
    let want = data(1 + prefix.len() as u64, len);
    let dir = tempfile::tempdir().unwrap();
    let _full = SmallTmpfs::at(&dir.path().join("state/hot"));
    let source = format!("s3://{}/{}", rgw.bucket, prefix.trim_end_matches('/'));
    let args = [
        "--endpoint",
        rgw.endpoint.as_str(),
        "--region",
        "us-east-1",
        "--hot-capacity",
        "64MiB",
        "--warm-capacity",
        "64MiB",
    ];
    let mut m = Mount::start_in(dir, &source, &args);
    for _ in 0..2 {
        assert_eq!(
            sha(&std::fs::read(m.path("big.bin")).unwrap()),
            sha(&want),
            "reads must go on with a full hot disk"
        );
    }
    m.stop();
}

/// The hot tier's files are removed underneath the mount (an operator's `rm`, a disk swapped):
/// reads go on, from the warm tier or RGW, with the right bytes, and none fails.
#[test]
#[ignore = "needs root (/dev/fuse) and Ceph RGW: run by .ci/run"]
fn fuse_root_rgw_hot_files_removed_underneath_reads_go_on() {
    let rgw = Rgw::from_env();
    let prefix = unique_prefix("mnt-hot-gone");
    let len = 6_000_000;
    rt().block_on(upload(rgw.store().as_ref(), &prefix, &[("big.bin", len)]));
    let want = data(1 + prefix.len() as u64, len);
    let dir = tempfile::tempdir().unwrap();
    let hot = dir.path().join("state/hot");
    let source = format!("s3://{}/{}", rgw.bucket, prefix.trim_end_matches('/'));
    let args = ["--endpoint", rgw.endpoint.as_str(), "--region", "us-east-1", "--no-passthrough"];
    let mut m = Mount::start_in(dir, &source, &args);
    assert_eq!(sha(&std::fs::read(m.path("big.bin")).unwrap()), sha(&want));
    let removed: Vec<_> = files_under(&hot).into_iter().filter(|p| std::fs::remove_file(p).is_ok()).collect();
    assert!(!removed.is_empty(), "the first read left nothing in the hot tier");
    // Past the page cache, so the reads reach the mount.
    std::fs::write("/proc/sys/vm/drop_caches", "1").unwrap();
    for _ in 0..2 {
        let got = std::fs::read(m.path("big.bin")).unwrap_or_else(|e| panic!("a read failed: {e}\n{}", m.log()));
        assert_eq!(sha(&got), sha(&want), "reads go on when the hot tier's files are gone");
        std::fs::write("/proc/sys/vm/drop_caches", "1").unwrap();
    }
    m.stop();
}
