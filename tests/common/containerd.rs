//! A real containerd for one test: its own root, state and socket in a temp dir, with Strata's
//! snapshotter as the `strata` proxy plugin, driven with `ctr`.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output};
use std::time::{Duration, Instant};

pub struct Containerd {
    pub dir: PathBuf,
    pub address: PathBuf,
    child: Option<Child>,
}

/// The registry that `.ci/run` starts and fills (tests/infra/registry.sh, images.sh).
pub fn registry() -> String {
    std::env::var("STRATA_TEST_REGISTRY").unwrap_or_else(|_| {
        panic!("STRATA_TEST_REGISTRY is not set: these tests need the registry that `bash .ci/run` starts")
    })
}

pub const NAMESPACE: &str = "strata-test";

/// The registry's access log, to count what was fetched.
pub fn registry_log() -> String {
    let path = std::env::var("STRATA_TEST_REGISTRY_LOG").unwrap_or_else(|_| {
        panic!("STRATA_TEST_REGISTRY_LOG is not set: these tests need the registry that `bash .ci/run` starts")
    });
    std::fs::read_to_string(path).unwrap()
}

/// The sizes of the ranged answers (206) for blob `digest` in the registry's log since `mark`.
pub fn ranged_answers(mark: usize, digest: &str) -> Vec<u64> {
    let blob = format!("/blobs/{digest} ");
    registry_log()[mark..]
        .lines()
        .filter(|l| l.contains("\"GET /v2/strata/") && l.contains(&blob))
        .filter_map(|l| l.split("\" 206 ").nth(1)?.split(' ').next()?.parse().ok())
        .collect()
}

/// The Accept of a client that wants an image manifest, not an index.
pub const MANIFEST_ACCEPT: &str =
    "Accept: application/vnd.oci.image.manifest.v1+json, application/vnd.docker.distribution.manifest.v2+json";

/// The digests and sizes of the blobs of `repo:tag` at the test registry: its config, then its
/// layers.
pub fn image_blobs(repo: &str, tag: &str) -> Vec<(String, u64)> {
    let url = format!("http://{}/v2/{repo}/manifests/{tag}", registry());
    let out = Command::new("curl").args(["-fsS", "-H", MANIFEST_ACCEPT, &url]).output().unwrap();
    let m: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let layers = m["layers"].as_array().unwrap().iter();
    std::iter::once(&m["config"])
        .chain(layers)
        .map(|l| (l["digest"].as_str().unwrap().to_owned(), l["size"].as_u64().unwrap()))
        .collect()
}

/// The bytes the registry sent of blob `digest` since `mark`, whole (200) or in ranges (206).
pub fn served(mark: usize, digest: &str) -> u64 {
    let blob = format!("/blobs/{digest} ");
    registry_log()[mark..]
        .lines()
        .filter(|l| l.contains("\"GET /v2/") && l.contains(&blob))
        .filter_map(|l| {
            let rest = l.split("\" 200 ").nth(1).or_else(|| l.split("\" 206 ").nth(1))?;
            rest.split(' ').next()?.parse::<u64>().ok()
        })
        .sum()
}

impl Containerd {
    /// Starts containerd with `[proxy_plugins.strata]` dialling `snapshotter_socket`, without
    /// its CRI plugin.
    pub fn start(dir: &Path, snapshotter_socket: &Path) -> Containerd {
        Containerd::start_with(dir, snapshotter_socket, false)
    }

    /// As [`Containerd::start`], with the CRI plugin on as the snippet configures it (images
    /// pulled through CRI unpack on Strata, with the annotations a lazy pull needs).
    pub fn start_with(dir: &Path, snapshotter_socket: &Path, cri: bool) -> Containerd {
        let address = dir.join("containerd.sock");
        // The shipped snippet (deploy/containerd/), pointed at this test's socket, with the
        // daemon's own dirs. The CRI plugin is off unless asked for: most tests drive ctr.
        let snippet =
            std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/containerd/config-1.6-1.7.toml"))
                .unwrap()
                .replace("/run/strata/snapshotter.sock", &snapshotter_socket.display().to_string());
        let disabled = if cri { "" } else { "disabled_plugins = [\"io.containerd.grpc.v1.cri\"]\n" };
        let own = format!(
            "version = 2\nroot = \"{root}\"\nstate = \"{state}\"\n{disabled}\
             [debug]\n  level = \"debug\"\n[grpc]\n  address = \"{address}\"\n",
            root = dir.join("root").display(),
            state = dir.join("state").display(),
            address = address.display(),
        );
        let config = dir.join("containerd.toml");
        std::fs::write(&config, snippet.replacen("version = 2\n", &own, 1)).unwrap();
        let log = std::fs::File::create(dir.join("containerd.log")).unwrap();
        let child = Command::new("containerd")
            .arg("--config")
            .arg(&config)
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("containerd starts (package containerd)");
        let mut c = Containerd { dir: dir.to_owned(), address, child: Some(child) };
        let deadline = Instant::now() + Duration::from_secs(30);
        while !c.ctr(&["version"]).status.success() {
            if let Some(status) = c.child.as_mut().unwrap().try_wait().unwrap() {
                panic!("containerd exited with {status}:\n{}", c.log());
            }
            assert!(Instant::now() < deadline, "containerd not ready after 30s:\n{}", c.log());
            std::thread::sleep(Duration::from_millis(100));
        }
        c
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("containerd.log")).unwrap_or_default()
    }

    /// `ctr --address A -n strata-test ARGS...`
    pub fn ctr(&self, args: &[&str]) -> Output {
        Command::new("ctr").arg("--address").arg(&self.address).args(["-n", NAMESPACE]).args(args).output().unwrap()
    }

    /// `ctr-remote` (stargz-snapshotter's ctr, with `image rpull`), on this containerd.
    pub fn ctr_remote(&self, args: &[&str]) -> Output {
        Command::new("ctr-remote")
            .arg("--address")
            .arg(&self.address)
            .args(["-n", NAMESPACE])
            .args(args)
            .output()
            .unwrap()
    }

    /// Waits (at most `limit`) until containerd reaches the `strata` plugin itself, as after
    /// the plugin's socket appears or comes back: containerd redials it with a backoff of up
    /// to 3 s, and calls meanwhile fail with Unavailable. `snapshots ls` and a Stat are no
    /// probe: containerd answers them from its own metadata. A Prepare goes to the plugin.
    pub fn wait_for_strata(&self, limit: Duration) {
        let deadline = Instant::now() + limit;
        for n in 0.. {
            let key = format!("strata-probe-{n}");
            let out = self.ctr(&["snapshots", "--snapshotter", "strata", "prepare", &key]);
            if out.status.success() {
                let _ = self.ctr(&["snapshots", "--snapshotter", "strata", "rm", &key]);
                return;
            }
            assert!(
                Instant::now() < deadline,
                "containerd did not reach the strata plugin in {limit:?}: {}\n{}",
                String::from_utf8_lossy(&out.stderr),
                self.log()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// As [`Containerd::ctr`], failing the test with both logs on a non-zero exit.
    pub fn ctr_ok(&self, args: &[&str], strata_log: &str) -> String {
        let out = self.ctr(args);
        assert!(
            out.status.success(),
            "ctr {args:?} failed: {}\n{}\n--- containerd log ---\n{}\n--- strata log ---\n{strata_log}",
            String::from_utf8_lossy(&out.stderr),
            String::from_utf8_lossy(&out.stdout),
            self.log(),
        );
        String::from_utf8(out.stdout).unwrap()
    }

    /// Runs `script` with `sh -c` in a new container of `image` on `snapshotter`, and returns
    /// what it wrote to its standard output. The output goes to a file bound into the
    /// container, not through `ctr`: `ctr run` can lose the whole output of a container that
    /// exits at once (a race of its I/O copy, known in containerd), while the container's own
    /// write to the file is done before it exits.
    pub fn run_captured(&self, snapshotter: &str, image: &str, name: &str, script: &str, strata_log: &str) -> String {
        let out = tempfile::tempdir().unwrap();
        let bind = format!("type=bind,src={},dst=/strata-out,options=rbind:rw", out.path().display());
        let script = format!("{{ {script}\n}} >/strata-out/stdout");
        let args = ["run", "--rm", "--snapshotter", snapshotter, "--mount", &bind, image, name, "sh", "-c", &script];
        self.ctr_ok(&args, strata_log);
        std::fs::read_to_string(out.path().join("stdout")).unwrap_or_else(|e| panic!("{name} left no output: {e}"))
    }
}

impl Drop for Containerd {
    fn drop(&mut self) {
        // Running containers first, so their shims let go of the rootfs mounts.
        for task in String::from_utf8_lossy(&self.ctr(&["tasks", "ls", "-q"]).stdout).lines() {
            let _ = self.ctr(&["tasks", "kill", "-s", "SIGKILL", task]);
            let _ = self.ctr(&["tasks", "delete", "-f", task]);
        }
        if let Some(mut c) = self.child.take() {
            let _ = Command::new("kill").arg("-TERM").arg(c.id().to_string()).status();
            let deadline = Instant::now() + Duration::from_secs(10);
            while c.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
        // Whatever is still mounted under our dir would keep the temp dir from going away.
        let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
        let prefix = self.dir.to_string_lossy().into_owned();
        let mut ours: Vec<&str> =
            mounts.lines().filter_map(|l| l.split(' ').nth(4)).filter(|m| m.starts_with(&prefix)).collect();
        ours.sort_by_key(|m| std::cmp::Reverse(m.len()));
        for m in ours {
            let _ = Command::new("umount").arg("-l").arg(m).stderr(std::process::Stdio::null()).status();
        }
    }
}
