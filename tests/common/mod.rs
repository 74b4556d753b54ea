//! Shared harness of the end-to-end tests: a real `strata daemon` process with its own dirs,
//! the `strata` CLI, and the Ceph RGW that `.ci/run` starts (see `tests/infra/rgw.sh`).
#![allow(dead_code)]

use object_store::ObjectStoreExt;
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output};
use std::sync::Arc;
use std::time::{Duration, Instant};

pub mod auth_registry;
pub mod containerd;
pub mod faulty;
pub mod kube;
pub mod mount;
pub mod netns;
pub mod node;
pub mod peer_node;
pub mod s3;
pub mod tree;
#[allow(unused_imports)]
pub use mount::{Mount, mounted};

pub const BIN: &str = env!("CARGO_BIN_EXE_strata");

/// Connection facts of the test RGW, from the environment `.ci/run` sets.
#[derive(Debug, Clone)]
pub struct Rgw {
    pub endpoint: String,
    pub bucket: String,
    pub access_key: String,
    pub secret_key: String,
}

impl Rgw {
    /// Panics with instructions when RGW is not configured: a test that needs it must not pass
    /// without it.
    pub fn from_env() -> Rgw {
        let var = |k: &str| {
            std::env::var(k).unwrap_or_else(|_| {
                panic!("{k} is not set: these tests need the Ceph RGW that `bash .ci/run` starts (tests/infra/rgw.sh)")
            })
        };
        Rgw {
            endpoint: var("STRATA_TEST_S3_ENDPOINT"),
            bucket: var("STRATA_TEST_S3_BUCKET"),
            access_key: var("AWS_ACCESS_KEY_ID"),
            secret_key: var("AWS_SECRET_ACCESS_KEY"),
        }
    }

    pub fn store(&self) -> Arc<dyn object_store::ObjectStore> {
        let s3 = object_store::aws::AmazonS3Builder::new()
            .with_endpoint(&self.endpoint)
            .with_bucket_name(&self.bucket)
            .with_region("us-east-1")
            .with_access_key_id(&self.access_key)
            .with_secret_access_key(&self.secret_key)
            .with_allow_http(true)
            .with_virtual_hosted_style_request(false)
            .build()
            .expect("test S3 client builds");
        Arc::new(s3)
    }

    /// The request lines of RGW's access log (`"METHOD /bucket/key..."`) that name a key
    /// starting with `prefix`, once at least `least` of them are there (RGW writes its log a
    /// moment after it answers; at most 10 s).
    pub fn requests_under(&self, prefix: &str, least: usize) -> Vec<String> {
        let log = std::env::var("STRATA_TEST_RGW_LOG")
            .unwrap_or_else(|_| panic!("STRATA_TEST_RGW_LOG is not set: tests/run-all.sh names RGW's log there"));
        let needle = format!(" /{}/{}", self.bucket, prefix);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        loop {
            let text = std::fs::read_to_string(&log).unwrap_or_else(|e| panic!("reading {log}: {e}"));
            let lines: Vec<String> = text
                .lines()
                .filter(|l| l.contains(" beast: "))
                .filter_map(|l| l.split('"').nth(1))
                .filter(|r| r.contains(&needle))
                .map(str::to_string)
                .collect();
            if lines.len() >= least || std::time::Instant::now() > deadline {
                return lines;
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
    }

    /// The `[cold]` section pointing at this RGW.
    pub fn cold_toml(&self, extra: &str) -> String {
        format!(
            "[cold]\nkind = \"s3\"\nbucket = \"{}\"\nendpoint = \"{}\"\nregion = \"us-east-1\"\nallow_http = true\n{extra}\n",
            self.bucket, self.endpoint
        )
    }
}

/// A unique key prefix per test, so tests share the bucket without seeing each other.
pub fn unique_prefix(name: &str) -> String {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos();
    format!("t-{name}-{}-{nanos}/", std::process::id())
}

/// Deterministic pseudo-random bytes (xorshift), so failures are reproducible.
pub fn data(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out.truncate(len);
    out
}

pub fn sha(b: &[u8]) -> String {
    hex::encode(Sha256::digest(b))
}

/// Uploads objects and returns (relative path, sha256) pairs.
pub async fn upload(
    store: &dyn object_store::ObjectStore,
    prefix: &str,
    objects: &[(&str, usize)],
) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for (i, (name, len)) in objects.iter().enumerate() {
        let bytes = data(i as u64 + 1 + prefix.len() as u64, *len);
        let path = format!("{prefix}{name}");
        store.put(&object_store::path::Path::from(path.as_str()), bytes.clone().into()).await.expect("upload to RGW");
        out.push((path, sha(&bytes)));
    }
    out
}

/// A `strata daemon` child process with private dirs.
pub struct Daemon {
    pub dir: tempfile::TempDir,
    pub config: PathBuf,
    pub socket: PathBuf,
    pub metrics: String,
    /// The network namespace it runs in (`/var/run/netns/NAME`), if not the host's.
    pub netns: Option<String>,
    /// Run under `strata supervise`, which keeps its FUSE connections across its restarts.
    pub supervised: bool,
    child: Option<Child>,
}

/// The text of `GET /metrics` at `addr` (`host:port`).
pub fn metrics_at(addr: &str) -> String {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    write!(s, "GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n").unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out
}

/// The value of the sample line that starts with `sample` (name and labels), 0 if absent.
pub fn metric_at(addr: &str, sample: &str) -> u64 {
    metrics_at(addr)
        .lines()
        .find_map(|l| l.strip_prefix(sample).and_then(|v| v.trim().parse::<f64>().ok()))
        .map(|v| v as u64)
        .unwrap_or(0)
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

impl Daemon {
    /// Writes a config with two tiers under a temp dir plus `body` (the `[cold]` section and
    /// any overrides), and starts the daemon.
    pub fn start(body: &str, hot: &str, warm: &str) -> Daemon {
        Daemon::start_as(body, hot, warm, false)
    }

    /// As [`Daemon::start`], under `strata supervise`.
    pub fn start_supervised(body: &str, hot: &str, warm: &str) -> Daemon {
        Daemon::start_as(body, hot, warm, true)
    }

    fn start_as(body: &str, hot: &str, warm: &str, supervised: bool) -> Daemon {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("admin.sock");
        let port = free_port();
        let config = dir.path().join("config.toml");
        let text = format!(
            "state_dir = \"{state}\"\n[admin]\nsocket = \"{sock}\"\n[metrics]\nlisten = \"127.0.0.1:{port}\"\n\
             [tiers.hot]\ncapacity = \"{hot}\"\n[tiers.warm]\ncapacity = \"{warm}\"\n{body}\n",
            state = dir.path().join("state").display(),
            sock = socket.display(),
        );
        std::fs::write(&config, text).unwrap();
        let metrics = format!("127.0.0.1:{port}");
        let mut d = Daemon { dir, config, socket, metrics, netns: None, supervised, child: None };
        d.spawn();
        d
    }

    /// Starts the daemon on an existing config file.
    pub fn with_config(dir: tempfile::TempDir, config: PathBuf, socket: PathBuf) -> Daemon {
        Daemon::with_config_in(dir, config, socket, None)
    }

    /// As [`Daemon::with_config`], in network namespace `netns` when given: entered with
    /// nsenter for the network alone, so its sockets and mounts stay where the test sees them.
    pub fn with_config_in(dir: tempfile::TempDir, config: PathBuf, socket: PathBuf, netns: Option<String>) -> Daemon {
        let mut d = Daemon { dir, config, socket, metrics: String::new(), netns, supervised: false, child: None };
        d.spawn();
        d
    }

    pub fn log_path(&self) -> PathBuf {
        self.dir.path().join("daemon.log")
    }

    /// A directory first on the daemon's PATH, for programs it runs (credential helpers).
    pub fn bin_dir(&self) -> PathBuf {
        self.dir.path().join("bin")
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    pub fn spawn(&mut self) {
        let seen = self.log().len();
        let log = std::fs::OpenOptions::new().create(true).append(true).open(self.log_path()).unwrap();
        let mut command = match &self.netns {
            Some(ns) => {
                let mut c = Command::new("nsenter");
                c.arg(format!("--net=/var/run/netns/{ns}")).arg(BIN);
                c
            }
            None => Command::new(BIN),
        };
        if self.supervised {
            command.args(["supervise", "--"]).arg(BIN);
        }
        let child = command
            .args(["daemon", "--config"])
            .arg(&self.config)
            .env("STRATA_LOG", std::env::var("STRATA_TEST_LOG").unwrap_or_else(|_| "info".into()))
            .env("NO_COLOR", "1")
            .env("PATH", format!("{}:{}", self.bin_dir().display(), std::env::var("PATH").unwrap_or_default()))
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("strata daemon starts");
        self.child = Some(child);
        self.wait_ready(seen);
    }

    /// Waits until the log past byte `seen` says the daemon is ready.
    fn wait_ready(&mut self, seen: usize) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while !self.log()[seen..].contains("strata daemon ready") {
            if let Some(status) = self.child.as_mut().unwrap().try_wait().unwrap() {
                panic!("daemon exited with {status}:\n{}", self.log());
            }
            assert!(Instant::now() < deadline, "daemon not ready after 30s:\n{}", self.log());
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The daemon's process id while it runs (under `supervise`, the daemon's, not the
    /// supervisor's).
    pub fn pid(&self) -> Option<u32> {
        let top = self.child.as_ref().map(Child::id)?;
        if !self.supervised {
            return Some(top);
        }
        let children = std::fs::read_to_string(format!("/proc/{top}/task/{top}/children")).ok()?;
        children.split_whitespace().next()?.parse().ok()
    }

    /// Under `supervise`: sends `signal` to the daemon and waits until the supervisor has
    /// started it again and it is ready. Returns how long that took.
    pub fn restart_with(&mut self, signal: &str) -> Duration {
        assert!(self.supervised, "only a supervised daemon is started again");
        let pid = self.pid().expect("the supervised daemon runs");
        let seen = self.log().len();
        let started = Instant::now();
        let ok = Command::new("kill").arg(format!("-{signal}")).arg(pid.to_string()).status().unwrap();
        assert!(ok.success(), "kill -{signal} {pid}");
        self.wait_ready(seen);
        assert_ne!(self.pid(), Some(pid), "the daemon was not started again:\n{}", self.log());
        started.elapsed()
    }

    pub fn kill9(&mut self) {
        if self.supervised
            && let Some(pid) = self.pid()
        {
            let _ = Command::new("kill").arg("-KILL").arg(pid.to_string()).status();
        }
        if let Some(mut c) = self.child.take() {
            c.kill().unwrap();
            c.wait().unwrap();
        }
    }

    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            Command::new("kill").arg("-TERM").arg(c.id().to_string()).status().unwrap();
            let deadline = Instant::now() + Duration::from_secs(20);
            loop {
                if c.try_wait().unwrap().is_some() {
                    break;
                }
                if Instant::now() > deadline {
                    c.kill().unwrap();
                    c.wait().unwrap();
                    panic!("daemon ignored SIGTERM:\n{}", self.log());
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }

    /// Runs `strata tier --socket S ARGS...`.
    pub fn tier(&self, args: &[&str]) -> Output {
        Command::new(BIN).arg("tier").arg("--socket").arg(&self.socket).args(args).output().unwrap()
    }

    /// As [`Daemon::tier`], failing the test on a non-zero exit.
    pub fn tier_ok(&self, args: &[&str]) -> String {
        let out = self.tier(args);
        assert!(
            out.status.success(),
            "strata tier {args:?} failed: {}\n{}\n--- daemon log ---\n{}",
            String::from_utf8_lossy(&out.stderr),
            String::from_utf8_lossy(&out.stdout),
            self.log()
        );
        String::from_utf8(out.stdout).unwrap()
    }

    pub fn status(&self) -> serde_json::Value {
        serde_json::from_str(&self.tier_ok(&["status", "--json"])).unwrap()
    }

    /// Bytes of an object read through the daemon's cache.
    pub fn cat(&self, path: &str) -> Vec<u8> {
        let out = self.tier(&["cat", path]);
        assert!(out.status.success(), "cat {path}: {}\n{}", String::from_utf8_lossy(&out.stderr), self.log());
        out.stdout
    }

    /// The value of one sample of the daemon's metrics (`name{labels}`), 0 when absent.
    pub fn metric(&self, sample: &str) -> u64 {
        metric_at(&self.metrics, sample)
    }

    pub fn metrics_text(&self) -> String {
        metrics_at(&self.metrics)
    }

    pub fn state(&self) -> &Path {
        self.dir.path()
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.kill9();
        // fusermount3 unmounts a dead daemon's mounts itself, but not always before the temp
        // dir goes; a mount left under it would keep the dir, and show in /proc/mounts.
        let prefix = self.dir.path().to_string_lossy().into_owned();
        let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
        for m in mounts.lines().filter_map(|l| l.split(' ').nth(4)).filter(|m| m.starts_with(&prefix)) {
            let _ = Command::new("umount").arg("-l").arg(m).stderr(std::process::Stdio::null()).status();
        }
    }
}

pub fn tier<'a>(status: &'a serde_json::Value, name: &str) -> &'a serde_json::Value {
    status["tiers"].as_array().unwrap().iter().find(|t| t["tier"] == name).unwrap()
}

pub fn files_under(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    if let Ok(rd) = std::fs::read_dir(dir) {
        for e in rd {
            let p = e.unwrap().path();
            if p.is_dir() { out.extend(files_under(&p)) } else { out.push(p) }
        }
    }
    out
}

pub fn bytes_on_disk(dir: &Path) -> u64 {
    files_under(dir).iter().map(|p| std::fs::metadata(p).map(|m| m.len()).unwrap_or(0)).sum()
}

/// A 1 MiB tmpfs mounted at `path` (created if missing), standing in for a full disk; unmounted
/// on drop. Needs root.
pub struct SmallTmpfs(PathBuf);

impl SmallTmpfs {
    pub fn at(path: &Path) -> SmallTmpfs {
        std::fs::create_dir_all(path).unwrap();
        let ok = Command::new("mount").args(["-t", "tmpfs", "-o", "size=1m", "tmpfs"]).arg(path).status().unwrap();
        assert!(ok.success(), "mounting a tmpfs needs root");
        SmallTmpfs(path.to_path_buf())
    }
}

impl Drop for SmallTmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
    }
}

/// The pages of `path` in the page cache: (cached, dirty or under writeback). Linux's
/// `cachestat` (6.5 and later), which neither libc's nor nix's wrappers offer yet; the one
/// `unsafe` is the raw syscall, with both structs laid out as the kernel's UAPI has them.
#[allow(unsafe_code)]
pub fn page_cache_state(path: &Path) -> (u64, u64) {
    use std::os::fd::AsRawFd;
    #[repr(C)]
    struct Range {
        off: u64,
        len: u64,
    }
    #[repr(C)]
    #[derive(Default)]
    struct Stat {
        cache: u64,
        dirty: u64,
        writeback: u64,
        evicted: u64,
        recently_evicted: u64,
    }
    const SYS_CACHESTAT: libc::c_long = 451;
    let f = std::fs::File::open(path).unwrap();
    let (range, mut st) = (Range { off: 0, len: 0 }, Stat::default());
    let rc = unsafe { libc::syscall(SYS_CACHESTAT, f.as_raw_fd(), &range, &mut st, 0) };
    assert_eq!(rc, 0, "cachestat: {}", std::io::Error::last_os_error());
    (st.cache, st.dirty + st.writeback)
}
