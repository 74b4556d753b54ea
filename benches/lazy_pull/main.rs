//! Lazy pulls against full pulls, on a shaped link to the registry (`bash benches/lazy_pull.sh`).
//!
//! For each link (rate by tc in the kernel, round trip by our delay proxy) and each image, one
//! run measures both sides on fresh nodes (a `strata daemon` and a containerd 1.6 of their own):
//! - the time from pull start to the first output of `python3 -c 'print(1)'`: lazily through
//!   Strata (`ctr-remote image rpull` + `ctr run --snapshotter strata`), and after a full pull
//!   with containerd's overlayfs snapshotter (`ctr image pull` + `ctr run`);
//! - the bytes the registry sent before that output, against the image's compressed size;
//! - the time from pull start until a container has read every file of the image.
//!
//! Needs root, containerd, runc, ctr-remote, tc and the test registry with its images; the
//! script starts those. Writes the table to `target/lazy_pull.md` too.

#[path = "../../tests/common/mod.rs"]
#[allow(unused_imports)]
mod common;
mod proxy;
mod shaper;

use common::Daemon;
use common::containerd::{Containerd, registry};
use proxy::DelayProxy;
use shaper::Shaper;
use std::io::BufRead;
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

struct Link {
    name: &'static str,
    rate: &'static str,
    bits_per_sec: f64,
    rtt: Duration,
}

const LINKS: [Link; 2] = [
    Link { name: "200 Mbit/s, 20 ms", rate: "200mbit", bits_per_sec: 200e6, rtt: Duration::from_millis(20) },
    Link { name: "1 Gbit/s, 2 ms", rate: "1gbit", bits_per_sec: 1e9, rtt: Duration::from_millis(2) },
];

const IMAGES: [(&str, &str); 3] = [
    ("python:esgz", "eStargz (ctr-remote convert)"),
    ("python:esgz-opt", "optimized (ctr-remote optimize)"),
    ("python:strata-record", "recorded (strata convert --record)"),
];

/// Reads every regular file of the container's root, through whatever the snapshotter mounted.
const READ_ALL: &str = "find / -xdev -type f -exec cat {} + >/dev/null";

#[derive(Debug, Clone, Copy)]
struct Sample {
    /// Until the pull command returned.
    pulled: Duration,
    first_output: Duration,
    bytes_before: u64,
    all_read: Duration,
    /// A second read of every file, in a new container, once all is local.
    reread: Duration,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Mode {
    Lazy,
    Full,
}

fn main() {
    let runs: usize = std::env::var("STRATA_BENCH_RUNS").ok().and_then(|r| r.parse().ok()).unwrap_or(5);
    let upstream: SocketAddr = registry().parse().expect("STRATA_TEST_REGISTRY is host:port");
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    // Subsets, for profiling one case: `STRATA_BENCH_LINKS=1gbit STRATA_BENCH_IMAGES=python:esgz`.
    let chosen = |var: &str, name: &str| std::env::var(var).map_or(true, |v| v.split(',').any(|c| c == name));
    let images: Vec<_> = IMAGES.iter().filter(|(image, _)| chosen("STRATA_BENCH_IMAGES", image)).collect();
    if images.iter().any(|(image, _)| *image == "python:strata-record") {
        record_image();
    }
    let mut report = String::new();
    for link in LINKS.iter().filter(|l| chosen("STRATA_BENCH_LINKS", l.rate)) {
        let proxy = rt.block_on(DelayProxy::start(upstream, link.rtt)).expect("delay proxy starts");
        let _shaper = Shaper::on_lo(proxy.addr.port(), link.rate).unwrap_or_else(|e| panic!("shaping lo: {e}"));
        let check = check_link(link, &proxy);
        println!("{}: {check}", link.name);
        report += &format!("\n### {}\n\n{check}\n\n", link.name);
        let settings = snapshotter_settings();
        if !settings.trim().is_empty() {
            report += &format!("Strata's `[snapshotter]` settings beyond the defaults: `{}`.\n\n", settings.trim());
        }
        report += "| image | compressed | full pull: first output | lazy: first output | ratio | bytes before first output | full pull: every file read | lazy: every file read | full-read penalty |\n";
        report += "| --- | --- | --- | --- | --- | --- | --- | --- | --- |\n";
        for &&(image, what) in &images {
            let size = compressed_size(image);
            let (mut full, mut lazy) = (Vec::new(), Vec::new());
            for run in 0..runs {
                // Alternated, so neither side always runs on a warmer machine.
                let order = if run % 2 == 0 { [Mode::Full, Mode::Lazy] } else { [Mode::Lazy, Mode::Full] };
                for mode in order {
                    let s = measure(mode, image, &proxy, run);
                    println!(
                        "{} {image} {mode:?} run {run}: pulled {:.2}s, first output {:.2}s with {} bytes, every file read {:.2}s, and again {:.2}s",
                        link.name,
                        s.pulled.as_secs_f64(),
                        s.first_output.as_secs_f64(),
                        s.bytes_before,
                        s.all_read.as_secs_f64(),
                        s.reread.as_secs_f64()
                    );
                    if mode == Mode::Full { &mut full } else { &mut lazy }.push(s);
                }
            }
            // Ratios are taken within a run, where both sides share the machine's state, and
            // the median of those is reported: single runs here vary by a third or more.
            let pairs = || full.iter().zip(&lazy);
            let first = median(pairs().map(|(f, l)| l.first_output.as_secs_f64() / f.first_output.as_secs_f64()));
            let penalty = median(pairs().map(|(f, l)| l.all_read.as_secs_f64() / f.all_read.as_secs_f64()));
            let secs = |v: &[Sample], f: fn(&Sample) -> Duration| median(v.iter().map(|s| f(s).as_secs_f64()));
            let bytes = median(lazy.iter().map(|s| s.bytes_before as f64));
            report += &format!(
                "| {image} ({what}) | {:.1} MB | {:.2} s | {:.2} s | **{first:.3}** | {:.1} MB ({:.1}%) | {:.2} s | {:.2} s | **{penalty:.2}** |\n",
                size as f64 / 1e6,
                secs(&full, |s| s.first_output),
                secs(&lazy, |s| s.first_output),
                bytes / 1e6,
                100.0 * bytes / size as f64,
                secs(&full, |s| s.all_read),
                secs(&lazy, |s| s.all_read),
            );
        }
    }
    println!("{report}");
    let out = concat!(env!("CARGO_MANIFEST_DIR"), "/target/lazy_pull.md");
    std::fs::write(out, &report).unwrap();
    println!("written to target/lazy_pull.md");
}

fn median(values: impl Iterator<Item = f64>) -> f64 {
    let mut v: Vec<f64> = values.collect();
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The shaper is only trusted after a check: a blob through the proxy arrives at the link's
/// rate after at least its round trips, while the registry's own port stays unshaped.
fn check_link(link: &Link, proxy: &DelayProxy) -> String {
    let (digest, size) = first_layer("python:esgz");
    let curl = |addr: &str| -> (f64, f64) {
        let out = Command::new("curl")
            .args(["-fsS", "-o", "/dev/null", "-w", "%{time_starttransfer} %{time_total}"])
            .arg(format!("http://{addr}/v2/strata/python/blobs/{digest}"))
            .output()
            .unwrap();
        assert!(out.status.success(), "curl via {addr}: {}", String::from_utf8_lossy(&out.stderr));
        let text = String::from_utf8(out.stdout).unwrap();
        let mut it = text.split(' ').map(|v| v.parse::<f64>().unwrap());
        (it.next().unwrap(), it.next().unwrap())
    };
    let (ttfb, total) = curl(&proxy.addr.to_string());
    let rate = size as f64 * 8.0 / (total - ttfb);
    let (_, direct_total) = curl(&registry());
    let direct = size as f64 * 8.0 / direct_total;
    let rtt = link.rtt.as_secs_f64();
    assert!(
        (0.8..1.1).contains(&(rate / link.bits_per_sec)),
        "the shaped link gives {:.0} Mbit/s, not {}",
        rate / 1e6,
        link.rate
    );
    // Handshake, then the request's round trip.
    assert!(ttfb >= 2.0 * rtt, "first byte after {ttfb:.4}s, under two round trips of {rtt}s");
    assert!(direct > 3.0 * link.bits_per_sec, "the registry's own port is slowed too: {:.0} Mbit/s", direct / 1e6);
    format!(
        "Checked with curl in the same run: a {:.1} MB blob through the link came at {:.0} Mbit/s, its first byte \
         after {:.1} ms (handshake and request, two round trips); the same blob from the registry's own port at \
         {:.0} Mbit/s.",
        size as f64 / 1e6,
        rate / 1e6,
        ttfb * 1e3,
        direct / 1e6
    )
}

fn manifest(image: &str) -> serde_json::Value {
    let (repo, tag) = image.split_once(':').unwrap();
    let out = Command::new("curl")
        .args(["-fsS", "-H", "Accept: application/vnd.oci.image.manifest.v1+json"])
        .arg(format!("http://{}/v2/strata/{repo}/manifests/{tag}", registry()))
        .output()
        .unwrap();
    assert!(out.status.success(), "manifest of {image}: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

fn compressed_size(image: &str) -> u64 {
    manifest(image)["layers"].as_array().unwrap().iter().map(|l| l["size"].as_u64().unwrap()).sum()
}

fn first_layer(image: &str) -> (String, u64) {
    let m = manifest(image);
    let l = &m["layers"][0];
    (l["digest"].as_str().unwrap().to_string(), l["size"].as_u64().unwrap())
}

/// `python:strata-record`: `strata convert --record` of `python:1` with the workload
/// `ctr-remote image optimize` ran for `:esgz-opt` (`python3 -c 'print(1)'`), at the same gzip
/// level, on a fresh node and the unshaped registry.
fn record_image() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("strata-snapshotter.sock");
    let daemon =
        Daemon::start(&format!("[snapshotter]\nenabled = true\nsocket = \"{}\"\n", socket.display()), "4GiB", "4GiB");
    let containerd = Containerd::start(dir.path(), &socket);
    let hosts = tempfile::tempdir().unwrap();
    let out = Command::new(common::BIN)
        .args(["convert", "--compression-level", "9", "--record", "--record-period", "60s"])
        .arg("--hosts-dir")
        .arg(hosts.path())
        .arg("--containerd-address")
        .arg(&containerd.address)
        .args(["--containerd-namespace", common::containerd::NAMESPACE])
        .arg("--socket")
        .arg(&daemon.socket)
        .arg(format!("{}/strata/python:1", registry()))
        .arg(format!("{}/strata/python:strata-record", registry()))
        .args(["--", "python3", "-c", "print(1)"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "strata convert --record: {}\n{}",
        String::from_utf8_lossy(&out.stderr),
        daemon.log()
    );
    println!("python:strata-record: {}", String::from_utf8_lossy(&out.stdout).trim());
}

/// Lines for the lazy side's `[snapshotter]` table beyond the defaults, from
/// `STRATA_BENCH_SNAPSHOTTER` (e.g. `prefetch_async_size = "0"`): empty, the defaults.
fn snapshotter_settings() -> String {
    std::env::var("STRATA_BENCH_SNAPSHOTTER").unwrap_or_default().replace("\\n", "\n")
}

/// One pull and start on a fresh node, through the proxy.
fn measure(mode: Mode, image: &str, proxy: &DelayProxy, run: usize) -> Sample {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("strata-snapshotter.sock");
    let daemon = Daemon::start(
        &format!("[snapshotter]\nenabled = true\nsocket = \"{}\"\n{}\n", socket.display(), snapshotter_settings()),
        "4GiB",
        "4GiB",
    );
    let containerd = Containerd::start(dir.path(), &socket);
    let reference = format!("{}/strata/{image}", proxy.addr);
    let snapshotter: &[&str] = if mode == Mode::Lazy { &["--snapshotter", "strata"] } else { &[] };
    let fail = |what: &str, out: &std::process::Output| -> ! {
        panic!(
            "{what}: {}\n--- containerd ---\n{}\n--- strata ---\n{}",
            String::from_utf8_lossy(&out.stderr),
            containerd.log(),
            daemon.log()
        )
    };

    // Every run starts from the same state: dirty pages of the run before written back, and
    // the page cache dropped, so the registry reads its blob from disk each time (without this,
    // a run after a full pull found the blob cached and ran a third faster).
    Command::new("sync").status().unwrap();
    std::fs::write("/proc/sys/vm/drop_caches", "3").expect("dropping the page cache needs root");
    let (sent0, t0) = (proxy.sent(), Instant::now());
    proxy::trace(format_args!("{mode:?} pull of {image} starts"));
    let pulled = match mode {
        Mode::Lazy => containerd.ctr_remote(&["image", "rpull", "--plain-http", "--snapshotter", "strata", &reference]),
        Mode::Full => containerd.ctr(&["image", "pull", "--plain-http", &reference]),
    };
    if !pulled.status.success() {
        fail("pull", &pulled);
    }
    let pull_time = t0.elapsed();
    proxy::trace(format_args!("pull returned"));
    let mut child = Command::new("ctr")
        .arg("--address")
        .arg(&containerd.address)
        .args(["-n", common::containerd::NAMESPACE, "run", "--rm"])
        .args(snapshotter)
        .args([reference.as_str(), &format!("first-{run}"), "python3", "-c", "print(1)"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
    let (first_output, bytes_before) = (t0.elapsed(), proxy.sent() - sent0);
    proxy::trace(format_args!("first output"));
    let out = child.wait_with_output().unwrap();
    if line != "1\n" || !out.status.success() {
        fail(&format!("python3 printed {line:?}"), &out);
    }

    if std::env::var_os("STRATA_BENCH_TRACE").is_some() {
        // What a start costs once everything it reads is local: the runtime, not the pull.
        let mut args = vec!["run", "--rm"];
        args.extend_from_slice(snapshotter);
        let name = format!("warm-{run}");
        args.extend_from_slice(&[reference.as_str(), &name, "python3", "-c", "print(1)"]);
        let warm = Instant::now();
        let out = containerd.ctr(&args);
        proxy::trace(format_args!("{mode:?}: a second start took {:?} ({})", warm.elapsed(), out.status));
    }
    let mut args = vec!["run", "--rm"];
    args.extend_from_slice(snapshotter);
    let name = format!("all-{run}");
    args.extend_from_slice(&[reference.as_str(), &name, "sh", "-c", READ_ALL]);
    let read = containerd.ctr(&args);
    if !read.status.success() {
        fail("reading every file", &read);
    }
    let all_read = t0.elapsed();
    // The same read once more, everything local now: what serving the files costs by itself.
    let name = format!("again-{run}");
    let again = Instant::now();
    let at = args.len() - 4;
    args[at] = &name;
    let read = containerd.ctr(&args);
    if !read.status.success() {
        fail("reading every file again", &read);
    }
    let reread = again.elapsed();
    if mode == Mode::Lazy && std::env::var_os("STRATA_BENCH_TRACE").is_some() {
        eprintln!("--- strata daemon log ---\n{}", daemon.log());
    }
    drop(containerd);
    drop(daemon);
    Sample { pulled: pull_time, first_output, bytes_before, all_read, reread }
}
