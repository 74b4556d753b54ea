//! Dataset mounts through daemon restarts, on real FUSE and the Ceph RGW that `.ci/run`
//! starts: under `strata supervise`, a reader holding a file open and opening files it has not
//! opened before sees every byte right, and no error, through a SIGKILL of the daemon and
//! through a handover (SIGUSR2).

mod common;

use common::*;
use object_store::{ObjectStoreExt, PutPayload, path::Path as ObjPath};
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const SMALL: usize = 120;

/// What a reader saw.
#[derive(Debug, Default)]
struct Seen {
    reads: u64,
    errors: Vec<String>,
    longest: Duration,
}

fn put(rgw: &Rgw, key: &str, bytes: Vec<u8>) {
    let store = rgw.store();
    let key = key.to_owned();
    s3::rt().block_on(async move { store.put(&ObjPath::from(key), PutPayload::from(bytes)).await.unwrap() });
}

/// Reads `big` (open all along) at offsets spread over it, and one small file per round that
/// this reader opens for the first time, checking each against `want`, until `stop`.
fn read_loop(
    mnt: PathBuf,
    big: Arc<Vec<u8>>,
    small: Arc<Vec<Vec<u8>>>,
    stop: Arc<AtomicBool>,
    seen: Arc<Mutex<Seen>>,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let f = std::fs::File::open(mnt.join("big.bin")).unwrap();
        let mut off = 0usize;
        let mut round = 0usize;
        let mut buf = vec![0u8; 256 << 10];
        while !stop.load(Ordering::Relaxed) {
            let started = Instant::now();
            let n = buf.len().min(big.len() - off);
            let mut err = match f.read_exact_at(&mut buf[..n], off as u64) {
                Ok(()) if buf[..n] == big[off..off + n] => None,
                Ok(()) => Some(format!("wrong bytes in big.bin at {off}")),
                Err(e) => Some(format!("big.bin at {off}: {e}")),
            };
            let i = round % SMALL;
            if err.is_none() && round < SMALL {
                err = match std::fs::read(mnt.join(format!("s/{i}.bin"))) {
                    Ok(b) if b == small[i] => None,
                    Ok(_) => Some(format!("wrong bytes in s/{i}.bin")),
                    Err(e) => Some(format!("s/{i}.bin: {e}")),
                };
            }
            let took = started.elapsed();
            let mut s = seen.lock().unwrap();
            s.reads += 1;
            s.longest = s.longest.max(took);
            if let Some(e) = err {
                s.errors.push(e);
            }
            drop(s);
            off = (off + (7 << 20) + 4096) % (big.len() - 1);
            round += 1;
            // Slow enough that the small files last across both restarts.
            std::thread::sleep(Duration::from_millis(40));
        }
    })
}

fn reads(seen: &Mutex<Seen>) -> u64 {
    seen.lock().unwrap().reads
}

/// Waits until the reader has gone on past `n` reads.
fn wait_reads_past(seen: &Mutex<Seen>, n: u64) {
    s3::wait_until(Duration::from_secs(30), || reads(seen) > n + 5);
    assert!(reads(seen) > n + 5, "the reader made no progress past read {n}");
}

#[test]
#[ignore = "needs root, /dev/fuse and Ceph RGW: run by .ci/run"]
fn fuse_root_rgw_an_open_dataset_file_reads_right_through_a_kill_and_a_handover() {
    let rgw = Rgw::from_env();
    let prefix = unique_prefix("restart");
    let big = Arc::new(data(91, 40 << 20));
    put(&rgw, &format!("{prefix}big.bin"), big.to_vec());
    let small: Arc<Vec<Vec<u8>>> = Arc::new((0..SMALL).map(|i| data(1000 + i as u64, 96 << 10)).collect());
    for (i, b) in small.iter().enumerate() {
        put(&rgw, &format!("{prefix}s/{i}.bin"), b.clone());
    }
    let mnt = tempfile::tempdir().unwrap();
    let body = rgw.cold_toml("chunk_size = \"1MiB\"")
        + &format!(
            "[[mounts]]\npath = \"{}\"\nprefix = \"{}\"\nread_only = true\n",
            mnt.path().display(),
            prefix.trim_end_matches('/')
        );
    let mut d = Daemon::start_supervised(&body, "1GiB", "1GiB");
    assert!(mount::mounted(mnt.path()), "the daemon did not mount its dataset:\n{}", d.log());

    let stop = Arc::new(AtomicBool::new(false));
    let seen = Arc::new(Mutex::new(Seen::default()));
    let reader = read_loop(mnt.path().to_owned(), big.clone(), small.clone(), stop.clone(), seen.clone());
    wait_reads_past(&seen, 0);

    let before_kill = reads(&seen);
    let killed = d.restart_with("KILL");
    wait_reads_past(&seen, before_kill);
    let before_handover = reads(&seen);
    let handed = d.restart_with("USR2");
    wait_reads_past(&seen, before_handover);
    stop.store(true, Ordering::Relaxed);
    reader.join().unwrap();

    let s = seen.lock().unwrap();
    assert!(s.errors.is_empty(), "the reader saw errors: {:?}\n{}", &s.errors[..s.errors.len().min(10)], d.log());
    assert_eq!(d.log().matches("took over the mount an earlier run left").count(), 2, "{}", d.log());
    // No request of the reader's was left unanswered: the longest one is the restart's pause.
    assert!(s.longest < Duration::from_secs(20), "a read waited {:?}", s.longest);
    eprintln!("reads {} longest {:?}; restart after SIGKILL {killed:?}, handover {handed:?}", s.reads, s.longest);
    drop(s);

    // A clean stop ends the mount and the supervisor with the daemon.
    d.stop();
    assert!(!mount::mounted(mnt.path()), "the mount outlived a clean stop");
    s3::delete_under(&rgw, &prefix);
}

/// A mount whose path is not made again after the restart (taken out of the config) does
/// not stay hanging: the successor unmounts it, as a clean stop would have.
#[test]
#[ignore = "needs root, /dev/fuse and Ceph RGW: run by .ci/run"]
fn fuse_root_rgw_a_kept_mount_no_longer_configured_is_unmounted_by_the_successor() {
    let rgw = Rgw::from_env();
    let prefix = unique_prefix("restart-gone");
    put(&rgw, &format!("{prefix}a.bin"), data(5, 1 << 20));
    let mnt = tempfile::tempdir().unwrap();
    let mounts =
        format!("[[mounts]]\npath = \"{}\"\nprefix = \"{}\"\n", mnt.path().display(), prefix.trim_end_matches('/'));
    let mut d = Daemon::start_supervised(&(rgw.cold_toml("") + &mounts), "256MiB", "256MiB");
    assert_eq!(std::fs::read(mnt.path().join("a.bin")).unwrap(), data(5, 1 << 20));
    let config = std::fs::read_to_string(&d.config).unwrap();
    std::fs::write(&d.config, config.replace(&mounts, "")).unwrap();
    d.restart_with("USR2");
    s3::wait_until(Duration::from_secs(10), || !mount::mounted(mnt.path()));
    assert!(!mount::mounted(mnt.path()), "the mount no longer configured is still there:\n{}", d.log());
    let started = Instant::now();
    let e = std::fs::read(mnt.path().join("a.bin")).expect_err("the file is still served");
    assert!(started.elapsed() < Duration::from_secs(5), "the read waited {:?}", started.elapsed());
    assert_eq!(e.kind(), std::io::ErrorKind::NotFound, "unexpected error {e}");
    s3::delete_under(&rgw, &prefix);
}
