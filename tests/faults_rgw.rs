//! Origin faults, through real FUSE mounts of the Ceph RGW that `.ci/run` starts, with the
//! fault-injecting proxy (`common::faulty`) between them: throttling and server errors are
//! retried with backoff, a reset, cut or stalled answer is taken up again, a store that keeps
//! failing gives EIO within the mount's timeout, and no wrong byte is ever served. Each mount
//! is fresh, so every read goes to the store.

mod common;

use common::faulty::{Fault, FaultyRegistry};
use common::mount::Mount;
use common::*;
use std::time::{Duration, Instant};

const CHUNKS: usize = 6;
/// The mount's bounds: each operation, retries included, and a silent connection.
const TIMEOUT: Duration = Duration::from_secs(6);
const STALL: Duration = Duration::from_secs(1);

struct Case {
    proxy: FaultyRegistry,
    mount: Mount,
    want: Vec<u8>,
    prefix: String,
    rgw: Rgw,
}

impl Case {
    /// `big.bin` of CHUNKS chunks on RGW, mounted through a proxy that has no fault yet.
    fn new(name: &str) -> Case {
        let rgw = Rgw::from_env();
        let prefix = unique_prefix(name);
        s3::rt().block_on(upload(rgw.store().as_ref(), &prefix, &[("big.bin", CHUNKS << 20)]));
        let want = s3::get(&rgw, &format!("{prefix}big.bin"));
        let upstream = rgw.endpoint.trim_start_matches("http://").to_owned();
        let proxy = FaultyRegistry::start(&upstream);
        let source = format!("s3://{}/{}", rgw.bucket, prefix.trim_end_matches('/'));
        let endpoint = format!("http://{}", proxy.addr);
        let (timeout, stall) = (format!("{}s", TIMEOUT.as_secs()), format!("{}ms", STALL.as_millis()));
        let args = [
            "--endpoint",
            endpoint.as_str(),
            "--region",
            "us-east-1",
            "--chunk-size",
            "1MiB",
            "--timeout",
            timeout.as_str(),
            "--stall-timeout",
            stall.as_str(),
            "--no-passthrough",
        ];
        let mount = Mount::start(&source, &args);
        Case { proxy, mount, want, prefix, rgw }
    }

    /// Reads the whole file once; the bytes, or the error, and how long it took.
    fn read(&self) -> (std::io::Result<Vec<u8>>, Duration) {
        let started = Instant::now();
        let got = std::fs::read(self.mount.path("big.bin"));
        (got, started.elapsed())
    }

    /// The request line of a GET of the file (its chunks), for a fault to hit.
    fn get_line(&self) -> String {
        format!("GET /{}/{}big.bin", self.rgw.bucket, self.prefix)
    }

    fn gets(&self) -> usize {
        self.proxy.requests_for("big.bin")
    }

    /// Reads with `fault` set and checks the bytes came right, and that every chunk and every
    /// hit of the fault was a request of its own (the hits were taken up again).
    fn survives(self, fault: Fault, hits: usize) {
        let before = self.gets();
        self.proxy.set(fault);
        let (got, took) = self.read();
        let got = got.unwrap_or_else(|e| panic!("the read failed: {e}\n{}", self.mount.log()));
        assert!(got == self.want, "wrong bytes were served");
        let asked = self.gets() - before;
        assert!(asked > CHUNKS + hits - 1, "{asked} requests for {CHUNKS} chunks and {hits} faults");
        assert!(took < TIMEOUT, "the read took {took:?}");
        eprintln!("{asked} requests, {took:?}");
        s3::delete_under(&self.rgw, &self.prefix);
    }
}

#[test]
#[ignore = "needs root, /dev/fuse and Ceph RGW: run by .ci/run"]
fn fuse_root_rgw_slowdown_answers_are_retried_with_backoff() {
    let c = Case::new("fault-slowdown");
    let fault = Fault::Status { pattern: c.get_line(), times: 3, status: 503, code: "SlowDown".into() };
    c.survives(fault, 3);
}

#[test]
#[ignore = "needs root, /dev/fuse and Ceph RGW: run by .ci/run"]
fn fuse_root_rgw_server_errors_are_retried() {
    let c = Case::new("fault-500");
    let fault = Fault::Status { pattern: c.get_line(), times: 2, status: 500, code: "InternalError".into() };
    c.survives(fault, 2);
    let c = Case::new("fault-503");
    let fault = Fault::Status { pattern: c.get_line(), times: 2, status: 503, code: "ServiceUnavailable".into() };
    c.survives(fault, 2);
}

#[test]
#[ignore = "needs root, /dev/fuse and Ceph RGW: run by .ci/run"]
fn fuse_root_rgw_a_connection_reset_mid_body_is_taken_up_again() {
    let c = Case::new("fault-reset");
    let fault = Fault::Reset { pattern: c.get_line(), times: 3 };
    c.survives(fault, 3);
}

#[test]
#[ignore = "needs root, /dev/fuse and Ceph RGW: run by .ci/run"]
fn fuse_root_rgw_a_body_cut_short_is_taken_up_again() {
    let c = Case::new("fault-truncate");
    let fault = Fault::TruncateNext { pattern: c.get_line(), times: 3 };
    c.survives(fault, 3);
}

#[test]
#[ignore = "needs root, /dev/fuse and Ceph RGW: run by .ci/run"]
fn fuse_root_rgw_a_stalled_transfer_is_cancelled_and_retried() {
    let c = Case::new("fault-stall");
    let fault = Fault::Stall { pattern: c.get_line(), times: 1 };
    let started = Instant::now();
    c.survives(fault, 1);
    // It waited for the stall to show, then fetched again.
    assert!(started.elapsed() >= STALL, "done in {:?}, before a stall could show", started.elapsed());
}

#[test]
#[ignore = "needs root, /dev/fuse and Ceph RGW: run by .ci/run"]
fn fuse_root_rgw_a_slow_store_is_slow_not_failing() {
    Case::new("fault-latency").survives(Fault::Latency(Duration::from_millis(300)), 0);
}

/// A store that answers every read with 500: the read fails with EIO, within the mount's
/// timeout, after bounded retries; once the store is back, the next read is right at once,
/// one request per chunk.
#[test]
#[ignore = "needs root, /dev/fuse and Ceph RGW: run by .ci/run"]
fn fuse_root_rgw_a_store_that_keeps_failing_gives_eio_in_bounded_time_then_recovers() {
    let c = Case::new("fault-down");
    let before = c.gets();
    c.proxy.set(Fault::Status { pattern: c.get_line(), times: usize::MAX, status: 500, code: "InternalError".into() });
    let (got, took) = c.read();
    let e = got.expect_err("a read of a store that only fails succeeded");
    assert_eq!(e.raw_os_error(), Some(libc::EIO), "{e}");
    assert!(took < 2 * (TIMEOUT + Duration::from_secs(1)), "the failing read took {took:?}");
    let tries = c.gets() - before;
    // 1 + 3 retries for each fetch: of the chunks read and read ahead, and of the read the
    // kernel asks again after its read-ahead failed. Bounded, not one more.
    assert!((4..=4 * (CHUNKS + 3)).contains(&tries), "{tries} requests");
    assert!(c.mount.log().contains("InternalError") || c.mount.log().contains("500"), "{}", c.mount.log());

    c.proxy.set(Fault::None);
    let before = c.gets();
    let (got, took) = c.read();
    assert!(got.expect("the read after the store came back") == c.want, "wrong bytes after the fault");
    assert!(took < TIMEOUT, "the read after the fault took {took:?}");
    // One GET per chunk, and at most the lookup's HEAD.
    let asked = c.gets() - before;
    assert!(asked <= CHUNKS + 1, "{asked} requests for {CHUNKS} chunks once the store is back");
    s3::delete_under(&c.rgw, &c.prefix);
}

/// A store that stalls every read: the read fails with EIO within the timeout, never hangs.
#[test]
#[ignore = "needs root, /dev/fuse and Ceph RGW: run by .ci/run"]
fn fuse_root_rgw_a_store_that_keeps_stalling_gives_eio_in_bounded_time() {
    let c = Case::new("fault-stall-all");
    c.proxy.set(Fault::Stall { pattern: c.get_line(), times: usize::MAX });
    let (got, took) = c.read();
    let e = got.expect_err("a read of a store that only stalls succeeded");
    assert_eq!(e.raw_os_error(), Some(libc::EIO), "{e}");
    // Each fetch gives up within the timeout (and a second for the last attempt's answer);
    // the kernel asks once more after its read-ahead failed.
    assert!(took < 2 * (TIMEOUT + Duration::from_secs(1)), "the stalled read took {took:?}");
    s3::delete_under(&c.rgw, &c.prefix);
}
